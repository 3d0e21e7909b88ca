//! The `s3` lease store: aws-sdk-s3 against AWS or any S3-compatible endpoint.
//!
//! Conditional create is `PutObject` with `If-None-Match: *`. Every store response's
//! `Date` header feeds the store-clock estimate (an SDK interceptor), so expiry is
//! judged on the store's clock without extra calls.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::BehaviorVersion;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::Region;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_smithy_http_client::tls;
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};
use bytes::Bytes;

use super::{CreateOutcome, LeaseStore, StoreError, StoredObject};
use crate::clock::{Clock, StoreClock};

/// Connection settings for an S3 store (the `[store]` section with `kind = "s3"`).
#[derive(Debug, Clone)]
pub struct S3Settings {
    /// `[store] bucket`.
    pub bucket: String,
    /// `[store] endpoint`; `None` is AWS.
    pub endpoint: Option<String>,
    /// `[store] region`.
    pub region: String,
    /// `[store] force_path_style`, which many S3-compatible servers need.
    pub force_path_style: bool,
    /// Bound on one store call, SDK retries included.
    pub timeout: Duration,
    /// Static credentials (tests); `None` uses the standard AWS chain.
    pub static_credentials: Option<(String, String)>,
}

/// The lease store on S3 or an S3-compatible server (SPEC §2), creating with
/// `If-None-Match: *` and estimating the store's clock from `Date`.
pub struct S3Store {
    client: aws_sdk_s3::Client,
    bucket: String,
    endpoint: String,
    clock: Arc<StoreClock>,
}

/// Feeds each store response's `Date` header, with the request's round trip, into
/// the store-clock estimate.
#[derive(Debug)]
struct DateObserver(Arc<StoreClock>);

/// When the request of a store call was handed to the HTTP client (local clock).
#[derive(Debug, Clone, Copy)]
struct SentAt(std::time::SystemTime);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

impl std::fmt::Debug for StoreClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreClock(offset {} ms)", self.offset_ms())
    }
}

impl Intercept for DateObserver {
    fn name(&self) -> &'static str {
        "fencegate::DateObserver"
    }

    fn read_before_transmit(
        &self,
        _ctx: &BeforeTransmitInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        cfg.interceptor_state()
            .store_put(SentAt(self.0.local_now()));
        Ok(())
    }

    fn read_after_transmit(
        &self,
        ctx: &BeforeDeserializationInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        // Without the send time (never, in practice) the round trip counts as 0,
        // which only narrows the window the estimate allows for.
        let sent = cfg
            .load::<SentAt>()
            .map_or_else(|| self.0.local_now(), |s| s.0);
        if let Some(date) = ctx.response().headers().get("date") {
            self.0.observe_date_header(date, sent);
        }
        Ok(())
    }
}

impl S3Store {
    /// Builds the client from the standard AWS chain (SPEC §9): every call bounded by
    /// `timeout`, SDK retries inside it, the store's clock read from each `Date`.
    /// Makes no store request.
    pub async fn connect(s: &S3Settings, local: Arc<dyn Clock>) -> S3Store {
        let http_client = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http_client)
            .region(Region::new(s.region.clone()));
        if let Some(ep) = &s.endpoint {
            loader = loader.endpoint_url(ep.clone());
        }
        if let Some((id, secret)) = &s.static_credentials {
            loader = loader.credentials_provider(aws_sdk_s3::config::Credentials::new(
                id.clone(),
                secret.clone(),
                None,
                None,
                "fencegate-static",
            ));
        }
        let sdk = loader.load().await;
        let clock = Arc::new(StoreClock::new(local));
        // A bounded call: the SDK retries transient failures (up to 3 attempts) inside
        // the operation timeout. A retried create may then see its own earlier write
        // as 412 — callers read back (lease::acquire).
        let attempt = (s.timeout / 2).max(Duration::from_millis(200));
        let conf = aws_sdk_s3::config::Builder::from(&sdk)
            .force_path_style(s.force_path_style)
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_timeout(s.timeout)
                    .operation_attempt_timeout(attempt)
                    .connect_timeout(attempt)
                    .build(),
            )
            .retry_config(RetryConfig::standard().with_max_attempts(3))
            .interceptor(DateObserver(clock.clone()))
            .build();
        S3Store {
            client: aws_sdk_s3::Client::from_conf(conf),
            bucket: s.bucket.clone(),
            endpoint: s.endpoint.clone().unwrap_or_else(|| "AWS".into()),
            clock,
        }
    }
}

fn status_of<E, R: HasStatus>(e: &SdkError<E, R>) -> Option<u16> {
    e.raw_response().map(HasStatus::status_u16)
}

trait HasStatus {
    fn status_u16(&self) -> u16;
}

impl HasStatus for aws_smithy_runtime_api::client::orchestrator::HttpResponse {
    fn status_u16(&self) -> u16 {
        self.status().as_u16()
    }
}

/// Maps an SDK error to what a caller may conclude from it.
fn classify<
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: HasStatus + std::fmt::Debug + 'static,
>(
    e: SdkError<E, R>,
) -> StoreError {
    let status = status_of(&e);
    let detail = match (e.code(), e.message()) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c.to_owned(),
        _ => cause_first(&e),
    };
    match (&e, status) {
        (SdkError::ConstructionFailure(_), _) => StoreError::Refused(detail),
        (SdkError::ServiceError(_), Some(s)) if (400..500).contains(&s) && s != 408 && s != 429 => {
            StoreError::Refused(format!("HTTP {s}: {detail}"))
        }
        (_, Some(s)) => StoreError::Unavailable(format!("HTTP {s}: {detail}")),
        _ => StoreError::Unavailable(detail),
    }
}

/// One line for an SDK failure without a service answer: the deepest cause first
/// (the SDK's own `DisplayErrorContext` ends in a Debug dump of the whole error
/// tree), then what to do about it.
fn cause_first(e: &(dyn std::error::Error + 'static)) -> String {
    let mut chain: Vec<String> = Vec::new();
    let mut cur = Some(e);
    while let Some(c) = cur {
        // Multi-line messages (the credential chain's attempts) keep their first line.
        let m = c.to_string();
        let m = m.lines().next().unwrap_or_default().trim().to_owned();
        if !m.is_empty() && !chain.iter().any(|p| p.contains(&m)) {
            chain.push(m);
        }
        cur = c.source();
    }
    let all = chain.join(": ");
    // The chain's last provider (instance metadata) speaks for all of them:
    // "IMDS is disabled", "failed to load IMDS session token".
    if all.contains("no credentials")
        || all.contains("credential provider")
        || all.contains("loading credentials")
    {
        return "no AWS credentials found (tried the environment, profile, web identity, ECS and instance metadata): \
                set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or give the host a role"
            .into();
    }
    let cause = chain.pop().unwrap_or_default();
    let hint = if all.contains("connect")
        || all.contains("dns")
        || all.contains("timed out")
        || all.contains("timeout")
    {
        "; check [store] endpoint and region, and that the store is reachable from here"
    } else {
        ""
    };
    if chain.is_empty() {
        format!("{cause}{hint}")
    } else {
        format!("{cause} ({}){hint}", chain.join(": "))
    }
}

fn is_precondition_conflict(status: Option<u16>, code: Option<&str>) -> bool {
    matches!(
        code,
        Some("PreconditionFailed" | "ConditionalRequestConflict")
    ) || matches!(status, Some(412))
        || (status == Some(409) && code == Some("ConditionalRequestConflict"))
}

impl S3Store {
    /// Every page of a listing under `prefix` (S3 answers 1,000 keys a page),
    /// each handed to `page` in turn.
    async fn each_page(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        start_after: Option<&str>,
        mut page: impl FnMut(&aws_sdk_s3::operation::list_objects_v2::ListObjectsV2Output),
    ) -> Result<(), StoreError> {
        let mut token: Option<String> = None;
        loop {
            let mut req = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(prefix)
                .set_delimiter(delimiter.map(str::to_owned))
                .set_start_after(start_after.map(str::to_owned));
            if let Some(t) = &token {
                req = req.continuation_token(t);
            }
            let out = req.send().await.map_err(classify)?;
            page(&out);
            match out.next_continuation_token() {
                Some(t) if out.is_truncated() == Some(true) => token = Some(t.to_owned()),
                _ => return Ok(()),
            }
        }
    }
}

#[async_trait]
impl LeaseStore for S3Store {
    async fn list_folders(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let mut folders = Vec::new();
        self.each_page(prefix, Some("/"), None, |out| {
            folders.extend(
                out.common_prefixes()
                    .iter()
                    .filter_map(|p| p.prefix().map(str::to_owned)),
            )
        })
        .await?;
        folders.sort();
        Ok(folders)
    }

    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        let mut keys = Vec::new();
        self.each_page(prefix, None, start_after, |out| {
            keys.extend(
                out.contents()
                    .iter()
                    .filter_map(|o| o.key().map(str::to_owned)),
            )
        })
        .await?;
        keys.sort();
        Ok(keys)
    }

    async fn list_first(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        max: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut req = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(prefix)
            .max_keys(i32::try_from(max.clamp(1, 1000)).unwrap_or(1000));
        if let Some(s) = start_after {
            req = req.start_after(s);
        }
        let out = req.send().await.map_err(classify)?;
        let mut keys: Vec<String> = out
            .contents()
            .iter()
            .filter_map(|o| o.key().map(str::to_owned))
            .collect();
        keys.sort();
        keys.truncate(max);
        Ok(keys)
    }

    async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError> {
        match self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(out) => {
                let last_modified = out
                    .last_modified()
                    .and_then(|d| SystemTime::try_from(*d).ok())
                    .ok_or_else(|| {
                        StoreError::Unavailable(format!("object {key} has no LastModified"))
                    })?;
                let body = out
                    .body
                    .collect()
                    .await
                    .map_err(|e| StoreError::Unavailable(format!("reading {key}: {e}")))?
                    .into_bytes();
                Ok(Some(StoredObject {
                    body,
                    last_modified,
                }))
            }
            Err(e) if e.code() == Some("NoSuchKey") || status_of(&e) == Some(404) => Ok(None),
            Err(e) => Err(classify(e)),
        }
    }

    async fn create_if_absent(&self, key: &str, body: Bytes) -> Result<CreateOutcome, StoreError> {
        let res = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .if_none_match("*")
            .content_type("application/json")
            .body(ByteStream::from(body))
            .send()
            .await;
        match res {
            Ok(_) => Ok(CreateOutcome::Created),
            Err(e) if is_precondition_conflict(status_of(&e), e.code()) => {
                Ok(CreateOutcome::AlreadyExists)
            }
            Err(e) => Err(classify(e)),
        }
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map(|_| ())
            .map_err(classify)
    }

    fn clock(&self) -> &StoreClock {
        &self.clock
    }

    fn describe(&self) -> String {
        format!("s3 store bucket {} at {}", self.bucket, self.endpoint)
    }
}
