//! Prometheus metrics (SPEC §8), encoded by `prometheus-client`.
//!
//! Request counters and latency histograms are updated on the request path.
//! Values that live elsewhere (marks, in-flight, drains, store calls, flush
//! batches, dedup counters) are read at scrape time by a collector, so the request
//! path pays nothing for them.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeMetric, LabelSetEncoder,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

pub mod collect;

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct RequestLabels {
    route: String,
    outcome: String,
    code: String,
}

/// An empty value leaves its label out: no series with `code=""` (a request that
/// was not refused) or `route=""` (one that matched no route).
impl EncodeLabelSet for RequestLabels {
    fn encode(&self, mut encoder: LabelSetEncoder) -> Result<(), std::fmt::Error> {
        for (k, v) in [
            ("route", &self.route),
            ("outcome", &self.outcome),
            ("code", &self.code),
        ] {
            if !v.is_empty() {
                (k, v.as_str()).encode(encoder.encode_label())?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

/// A route's own series, resolved once when the route is built: the labelled
/// lookup allocates, and these are touched by every request.
#[derive(Clone, Debug)]
pub struct RouteMetrics {
    /// `fencegate_requests_total{route, outcome="forwarded"}`.
    pub forwarded: Counter,
    /// `fencegate_admission_duration_seconds{route}`.
    pub admission: Histogram,
    /// `fencegate_upstream_duration_seconds{route}`.
    pub upstream: Histogram,
}

fn admission_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 2.0, 18))
}

fn upstream_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_1, 2.0, 18))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: &'static str,
}

/// fencegate's Prometheus registry and the series the proxy, admin API and collector
/// update (SPEC §8).
pub struct Metrics {
    /// Locked only to register (at start-up) and to render (a scrape): the
    /// request path holds its own handles to the series.
    registry: std::sync::Mutex<Registry>,
    requests: Family<RequestLabels, Counter>,
    admission: Family<RouteLabel, Histogram, fn() -> Histogram>,
    upstream: Family<RouteLabel, Histogram, fn() -> Histogram>,
    reloads: Family<ReloadLabels, Counter>,
    last_reload_ok: Gauge,
    /// The proxy listener's open and parked connections.
    pub connections: ConnGauges,
    /// The admin listener's.
    pub admin_connections: ConnGauges,
}

impl Metrics {
    /// The request path's counters and histograms; what lives elsewhere is read
    /// at scrape time by collectors registered once it exists
    /// ([`collect::register`]).
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "fencegate_requests",
            "Requests by route, outcome (forwarded, replayed, refused) and error code",
            requests.clone(),
        );
        let admission = Family::<RouteLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            admission_histogram,
        );
        registry.register(
            "fencegate_admission_duration_seconds",
            "Time to admit a request, by route: validation, store reads when needed, mark flush and drain",
            admission.clone(),
        );
        let upstream = Family::<RouteLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            upstream_histogram,
        );
        registry.register(
            "fencegate_upstream_duration_seconds",
            "Time from forwarding to the complete upstream response (or failure), by route",
            upstream.clone(),
        );
        registry.register_collector(Box::new(ProcessCollector));
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "fencegate_config_reloads",
            "Config reloads (SIGHUP) by result: applied, or refused (the running config kept)",
            reloads.clone(),
        );
        let last_reload_ok = Gauge::default();
        last_reload_ok.set(1);
        registry.register(
            "fencegate_config_last_reload_successful",
            "0 when the last reload was refused (the file on disk is not what runs), else 1",
            last_reload_ok.clone(),
        );
        let connections = ConnGauges::default();
        registry.register(
            "fencegate_connections_open",
            "Client connections open on the proxy listener",
            connections.open.clone(),
        );
        registry.register(
            "fencegate_connections_parked",
            "Of those, connections waiting for their next request without HTTP buffers (idle HTTP/1 keep-alive, or no request yet)",
            connections.parked.clone(),
        );
        registry.register(
            "fencegate_connections_refused",
            "Client connections closed at accept: max_connections (or the descriptor budget) reached",
            connections.refused.clone(),
        );
        let admin_connections = ConnGauges::default();
        registry.register(
            "fencegate_admin_connections_open",
            "Connections open on the admin listener",
            admin_connections.open.clone(),
        );
        registry.register(
            "fencegate_admin_connections_evicted",
            "Idle admin connections closed to make room for a new one (admin_max_connections reached)",
            admin_connections.evicted.clone(),
        );
        Arc::new(Metrics {
            registry: std::sync::Mutex::new(registry),
            requests,
            admission,
            upstream,
            reloads,
            last_reload_ok,
            connections,
            admin_connections,
        })
    }

    /// Counts one request in `fencegate_requests_total{route, outcome, code}`.
    pub fn request(&self, route: &str, outcome: &str, code: &str) {
        self.request_counter(route, outcome, code).inc();
    }

    /// The counter behind one label set, to keep and increment without the lookup.
    pub fn request_counter(&self, route: &str, outcome: &str, code: &str) -> Counter {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                outcome: outcome.to_owned(),
                code: code.to_owned(),
            })
            .clone()
    }

    /// A reload's result: applied, or refused with the running config kept.
    pub fn reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "refused" };
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
        self.last_reload_ok.set(i64::from(applied));
    }

    /// The series of route `route`, to keep with the route.
    pub fn for_route(&self, route: &str) -> RouteMetrics {
        let label = RouteLabel {
            route: route.to_owned(),
        };
        RouteMetrics {
            forwarded: self.request_counter(route, "forwarded", ""),
            admission: self.admission.get_or_create(&label).clone(),
            upstream: self.upstream.get_or_create(&label).clone(),
        }
    }

    /// Registers what a collector or another owner of series adds.
    pub fn with_registry(&self, add: impl FnOnce(&mut Registry)) {
        add(&mut self.registry.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// The Prometheus/OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// Counts of a listener's connections (`fencegate_connections_*` for the
/// proxy listener, `fencegate_admin_connections_*` for the admin one).
#[derive(Clone, Default)]
pub struct ConnGauges {
    /// Connections open now.
    pub open: Gauge,
    /// Idle HTTP/1 connections parked now.
    pub parked: Gauge,
    /// Connections closed at accept: the listener's cap was reached.
    pub refused: Counter,
    /// Idle connections closed to make room for a new one (the admin listener).
    pub evicted: Counter,
}

pub(crate) fn emit<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    ty: MetricType,
    rows: Vec<(Vec<(&'static str, String)>, M)>,
) -> Result<(), std::fmt::Error> {
    let mut fam = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, m) in rows {
        let me = fam.encode_family(&labels)?;
        m.encode(me)?;
    }
    Ok(())
}

/// `fencegate_build_info`, and the process metrics Prometheus' own client
/// libraries export (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_open_fds`, …), read from `/proc` at scrape time (Linux only; elsewhere
/// they are left out).
#[derive(Debug)]
struct ProcessCollector;

/// The git commit the binary was built from, as `main` hands it over
/// ([`set_commit`]); "unknown" in a process that did not (tests).
static COMMIT: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// Sets the commit `fencegate_build_info` reports (once, at start-up).
pub fn set_commit(commit: &'static str) {
    let _ = COMMIT.set(commit);
}

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        emit(
            &mut enc,
            "fencegate_build_info",
            "The running build: version and git commit (always 1)",
            MetricType::Gauge,
            vec![(
                vec![
                    ("version", env!("CARGO_PKG_VERSION").to_owned()),
                    (
                        "commit",
                        COMMIT.get().copied().unwrap_or("unknown").to_owned(),
                    ),
                ],
                ConstGauge::new(1),
            )],
        )?;
        let Some(p) = process::read() else {
            return Ok(());
        };
        emit(
            &mut enc,
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            MetricType::Counter,
            vec![(vec![], ConstCounter::new(p.cpu_seconds))],
        )?;
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                p.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                p.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                p.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                p.max_fds,
            ),
        ];
        for (name, help, v) in gauges {
            emit(
                &mut enc,
                name,
                help,
                MetricType::Gauge,
                vec![(vec![], ConstGauge::new(v as f64))],
            )?;
        }
        emit(
            &mut enc,
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch in seconds",
            MetricType::Gauge,
            vec![(vec![], ConstGauge::new(p.start_time_seconds))],
        )?;
        Ok(())
    }
}

/// Reading this process's figures from `/proc`.
mod process {
    /// Clock ticks per second of `/proc/*/stat` times: `USER_HZ`, 100 on every
    /// Linux architecture Rust targets (the ABI fixes it; `sysconf` is unsafe).
    const TICKS: f64 = 100.0;

    pub(super) struct Figures {
        pub cpu_seconds: f64,
        pub resident_bytes: u64,
        pub virtual_bytes: u64,
        pub open_fds: u64,
        pub max_fds: u64,
        pub start_time_seconds: f64,
    }

    pub(super) fn read() -> Option<Figures> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name, which may itself hold spaces or ')'.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
        // proc(5) numbers fields from 1 with the state as field 3: index = n - 3.
        let (utime, stime, start, vsize) = (num(11)?, num(12)?, num(19)?, num(20)?);
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let rss_kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?;
        let btime = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<u64>().ok())?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        let max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("Max open files"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        Some(Figures {
            cpu_seconds: (utime + stime) as f64 / TICKS,
            resident_bytes: rss_kb * 1024,
            virtual_bytes: vsize,
            open_fds,
            max_fds,
            start_time_seconds: btime as f64 + start as f64 / TICKS,
        })
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn this_process_has_plausible_figures() {
            let Some(p) = super::read() else {
                return; // not Linux
            };
            assert!(p.resident_bytes > 1 << 20, "{}", p.resident_bytes);
            assert!(p.virtual_bytes >= p.resident_bytes);
            assert!(p.open_fds >= 3 && p.max_fds >= p.open_fds);
            assert!(p.start_time_seconds > 1.6e9, "{}", p.start_time_seconds);
        }
    }
}
