//! `[telemetry]` (SPEC §9): trace export.

use super::*;

/// `[telemetry]`: OTLP/HTTP trace export (SPEC §9, docs/traces.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector's base URL (`http://collector:4318`): spans are POSTed to
    /// `{otlp_endpoint}/v1/traces`. None: no span is made or exported.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Of the requests that come without a sampled parent, the share traced
    /// (0.0–1.0); a worker's `traceparent` decides for its own requests.
    pub sample_ratio: f64,
    /// Spans waiting for export beyond this are dropped (and counted), never waited for.
    pub max_queue_spans: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "fencegate".into(),
            sample_ratio: 1.0,
            max_queue_spans: 4096,
        }
    }
}

impl Config {
    pub(super) fn validate_telemetry(&self) -> Result<(), String> {
        let t = &self.telemetry;
        if let Some(e) = &t.otlp_endpoint {
            let uri: Uri = e
                .parse()
                .map_err(|_| format!("[telemetry] otlp_endpoint {e:?} is not a URL"))?;
            if !matches!(uri.scheme_str(), Some("http" | "https"))
                || uri.authority().is_none_or(|a| a.as_str().contains('@'))
                || uri.query().is_some()
            {
                return Err(format!(
                    "[telemetry] otlp_endpoint {e:?} must be an http:// or https:// URL without credentials or a query (spans go to its /v1/traces)"
                ));
            }
        }
        if !(0.0..=1.0).contains(&t.sample_ratio) {
            return Err(format!(
                "[telemetry] sample_ratio ({}) must be between 0.0 and 1.0",
                t.sample_ratio
            ));
        }
        if t.max_queue_spans == 0 || t.service_name.is_empty() {
            return Err(
                "[telemetry] max_queue_spans must be positive and service_name not empty".into(),
            );
        }
        Ok(())
    }
}
