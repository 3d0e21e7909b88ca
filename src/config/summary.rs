//! `check-config`'s summary: what the configuration says, section by section,
//! never a secret's value.

use std::fmt::Write;

use super::*;

impl Config {
    /// A readable summary for `check-config` (never prints secret values):
    /// a few lines per section, in the order SPEC §9 lists them.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        self.summarize_server(&mut out);
        self.summarize_store(&mut out);
        self.summarize_dedup_and_traces(&mut out);
        self.summarize_state_and_mode(&mut out);
        for r in &self.routes {
            self.summarize_route(&mut out, r);
        }
        out
    }

    fn summarize_server(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "listen        {}{}",
            self.server.listen,
            if self.server.tls.is_some() {
                " (TLS: HTTP/1.1 and HTTP/2 via ALPN)"
            } else {
                ""
            }
        );
        let _ = writeln!(out, "admin_listen  {}", self.server.admin_listen);
        let _ = writeln!(out, "data_dir      {}", shown(&self.server.data_dir));
        let _ = writeln!(
            out,
            "shutdown      serve {} ms not ready, then drain up to {} ms",
            self.server.shutdown_delay_ms, self.server.shutdown_timeout_ms
        );
        let _ = writeln!(
            out,
            "admin_token   {}",
            if self.server.admin_token.is_some() {
                "set (mutating admin calls enabled)"
            } else {
                "not set in config"
            }
        );
    }

    fn summarize_store(&self, out: &mut String) {
        let s = &self.store;
        match s.kind {
            StoreKind::Dir => {
                let _ = writeln!(
                    out,
                    "store         dir at {} (prefix {:?})",
                    shown(&s.path),
                    s.prefix
                );
            }
            StoreKind::S3 => {
                let _ = writeln!(
                    out,
                    "store         s3 bucket {} at {} region {} path-style {} (prefix {:?})",
                    s.bucket.as_deref().unwrap_or("?"),
                    s.endpoint.as_deref().unwrap_or("AWS"),
                    s.region,
                    s.force_path_style,
                    s.prefix
                );
            }
        }
        let _ = writeln!(
            out,
            "              refresh every {} ms, grace {} ms, call timeout {} ms",
            s.refresh_interval_ms, s.grace_ms, s.timeout_ms
        );
    }

    fn summarize_dedup_and_traces(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "dedup ttl     {}",
            humantime::format_duration(self.dedup.ttl)
        );
        let _ = match &self.telemetry.otlp_endpoint {
            None => writeln!(out, "traces        off"),
            Some(e) => writeln!(
                out,
                "traces        OTLP/HTTP to {}/v1/traces as {:?}, sample_ratio {}, queue {} spans",
                e.trim_end_matches('/'),
                self.telemetry.service_name,
                self.telemetry.sample_ratio,
                self.telemetry.max_queue_spans
            ),
        };
    }

    fn summarize_state_and_mode(&self, out: &mut String) {
        let _ = match self.state.kind {
            StateKind::Sled => writeln!(out, "state         sled in data_dir"),
            // The connection string may hold a password: never shown.
            StateKind::Postgres => writeln!(
                out,
                "state         postgres (url hidden), schema {}, pool {}, timeout {} ms{}",
                self.state
                    .schema
                    .as_deref()
                    .unwrap_or("the connection's search_path"),
                self.state.pool_size,
                self.state.timeout_ms,
                self.state
                    .ca_file
                    .as_ref()
                    .map_or(String::new(), |c| format!(", CA {}", shown(c)))
            ),
        };
        match &self.cluster {
            None => {
                let _ = writeln!(out, "mode          single instance (instance guard)");
            }
            Some(c) => {
                let _ = writeln!(
                    out,
                    "mode          cluster: instance {} of {} shards, advertise {} (peer token hidden)",
                    c.instance_id, c.shards, c.advertise
                );
            }
        }
    }

    fn summarize_route(&self, out: &mut String, r: &RouteConfig) {
        let _ = writeln!(out, "route {:?}", r.name);
        let _ = writeln!(
            out,
            "  {} -> {}  (lease {})",
            r.path_prefix, r.upstream, r.lease
        );
        let _ = writeln!(
            out,
            "  timeout {} ms, drain {} ms, token {}, derive_key {}, in_doubt {}, dedup_header {}",
            r.timeout_ms,
            r.drain_timeout().as_millis(),
            if r.require_token {
                "required"
            } else {
                "not required"
            },
            r.derive_key.as_str(),
            r.in_doubt.as_str(),
            r.dedup_header
        );
        let _ = writeln!(
            out,
            "  protects its upstream: max_in_flight {}, Retry-After {}, breaker {}, rate {}",
            r.max_in_flight.map_or("none".into(), |n| n.to_string()),
            if r.honor_retry_after {
                format!(
                    "honoured up to {}",
                    humantime::format_duration(r.max_retry_after)
                )
            } else {
                "not honoured".into()
            },
            r.breaker.map_or("none".into(), |b| format!(
                "{} failures within {}, cool-down {}",
                b.failures,
                humantime::format_duration(b.window),
                humantime::format_duration(b.cool_down)
            )),
            r.rate.map_or("none".into(), |rate| format!(
                "{rate} (burst {}, per instance)",
                r.rate_burst.unwrap_or_else(|| rate.default_burst())
            ))
        );
        match r.delivery {
            Delivery::Direct => {
                let _ = writeln!(out, "  delivery direct");
            }
            Delivery::Queued => {
                let steps: Vec<String> = r
                    .retry
                    .schedule
                    .iter()
                    .map(|d| humantime::format_duration(*d).to_string())
                    .collect();
                let _ = writeln!(
                        out,
                        "  delivery queued (ordering {}), retries after {}; keeps at most {} messages and {} bytes (all routes: {} and {})",
                        match r.ordering {
                            Ordering::Lease => "lease",
                            Ordering::None => "none",
                        },
                        steps.join(", "),
                        r.queue_max_messages.map_or("any".into(), |n| n.to_string()),
                        r.queue_max_bytes.map_or("any".into(), |n| n.to_string()),
                        self.state.queue_max_messages,
                        self.state.queue_max_bytes,
                    );
            }
        }
        if !r.upstream_headers.is_empty() {
            let names: Vec<_> = r.upstream_headers.keys().map(String::as_str).collect();
            let _ = writeln!(out, "  sets headers {} (values hidden)", names.join(", "));
        }
        if let Some(ca) = &r.ca_file {
            let _ = writeln!(out, "  trusts CA {}", shown(ca));
        }
        if let (Some(c), Some(k)) = (&r.client_cert, &r.client_key) {
            let _ = writeln!(
                out,
                "  client certificate {} (key {}, matches)",
                shown(c),
                shown(k)
            );
        }
        if !r.signing_secrets.is_empty() {
            let _ = writeln!(
                    out,
                    "  signs Standard Webhooks with {} secret(s) (values hidden); body read whole up to {} bytes",
                    r.signing_secrets.len(),
                    r.max_body_bytes
                );
        }
    }
}
