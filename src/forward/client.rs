//! The pooled upstream client (SPEC §3): hyper-util's over rustls, its
//! connections cuttable (`cutoff`), and the TLS roots it trusts.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use super::client_auth::Identity;
use crate::cutoff::CuttableConnector;
use crate::streaming::UpBody;

/// hyper-util's pooled client (HTTP/1.1 and h2 over rustls).
type Pooled = Client<hyper_rustls::HttpsConnector<CuttableConnector>, UpBody>;

/// The upstream client, shared by every route: plain-`http://` upstreams on
/// connections driven by their requests ([`super::inline`]), HTTPS ones on
/// hyper-util's pool.
#[derive(Clone)]
pub struct HttpsClient {
    pooled: Pooled,
    own: Arc<super::inline::Pool>,
}

impl HttpsClient {
    /// hyper-util's pool, for an exchange that is not an upstream's (trace export).
    pub fn request(
        &self,
        req: http::Request<UpBody>,
    ) -> hyper_util::client::legacy::ResponseFuture {
        self.pooled.request(req)
    }

    pub(super) fn pooled(&self) -> &Pooled {
        &self.pooled
    }

    pub(super) fn own(&self) -> &Arc<super::inline::Pool> {
        &self.own
    }
}

/// Builds the TLS client config: system roots when present, else webpki roots,
/// plus an optional per-route CA bundle; with a route's client certificate
/// when it has one.
pub fn tls_config(
    extra_ca: Option<&std::path::Path>,
    identity: Option<&Identity>,
) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if added == 0 {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    if let Some(path) = extra_ca {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("reading CA bundle {}: {e}", path.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("parsing CA bundle {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!("CA bundle {} holds no certificate", path.display()));
        }
        for c in certs {
            roots
                .add(c)
                .map_err(|e| format!("CA bundle {}: {e}", path.display()))?;
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots);
    match identity {
        Some(id) => id.apply(builder),
        None => Ok(builder.with_no_client_auth()),
    }
}

/// A pooled client for one upstream (or a set of upstreams sharing TLS roots),
/// keeping at most `idle_per_host` idle connections to each host (the
/// descriptor budget's share, [`crate::budget`]).
pub fn client(
    tls: rustls::ClientConfig,
    connect_timeout: Duration,
    idle_per_host: usize,
) -> HttpsClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    let own = super::inline::Pool::new(CuttableConnector(http.clone()), idle_per_host);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(CuttableConnector(http));
    let pooled = Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(idle_per_host)
        .build(https);
    HttpsClient { pooled, own }
}
