//! Standard Webhooks signatures (SPEC §3, §9 `signing_secrets`): what lets a
//! receiver check that a delivery came from the sender and was not altered or
//! replayed late.
//!
//! A signing route sets `webhook-id` (the request's dedup key: the same on every
//! retry, which is what receivers deduplicate on), `webhook-timestamp` (Unix
//! seconds when forwarded) and `webhook-signature`: `v1,` + base64 of
//! HMAC-SHA256 over `{id}.{timestamp}.{body}`, once per secret, space-separated
//! — two secrets during a rotation, so receivers holding either one accept.

use std::time::SystemTime;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::DecodePaddingMode;
use base64::Engine;
use hmac::{Hmac, Mac};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;

/// `webhook-id`: the dedup key.
pub const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
/// `webhook-timestamp`: Unix seconds at forward time.
pub const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
/// `webhook-signature`: one `v1,<base64>` per secret, space-separated.
pub const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// The three headers a signing route sets (and replaces if the worker sent them).
pub const SIGNED_HEADERS: [HeaderName; 3] = [WEBHOOK_ID, WEBHOOK_TIMESTAMP, WEBHOOK_SIGNATURE];

/// The shortest secret accepted: the Standard Webhooks spec asks for 24 to 64
/// bytes; a shorter one is refused rather than signed with.
pub const MIN_SECRET_BYTES: usize = 24;

/// Standard base64, padded or not: the receivers' libraries accept both forms
/// of a secret, so fencegate does too.
const SECRET_B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// A route's signing keys, each an HMAC already keyed (cloned per delivery, so a
/// secret is decoded and keyed once per load, not per request). Its `Debug`
/// shows only how many: the secrets are never logged.
#[derive(Clone)]
pub struct Signer {
    keys: Vec<Hmac<Sha256>>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({} secrets, hidden)", self.keys.len())
    }
}

/// Decodes one secret: `whsec_` (optional, as the receivers' libraries accept)
/// followed by standard base64 (padded or not) of at least [`MIN_SECRET_BYTES`] bytes. The error
/// never quotes the value.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
    let raw = SECRET_B64
        .decode(b64.trim())
        .map_err(|_| "is not whsec_ followed by base64 (value hidden)".to_owned())?;
    if raw.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "decodes to {} bytes; a Standard Webhooks secret has at least {MIN_SECRET_BYTES}",
            raw.len()
        ));
    }
    Ok(raw)
}

impl Signer {
    /// Keys for `secrets` (resolved from the environment already), in order: the
    /// signatures follow the same order. An error names the secret's position.
    pub fn new<S: AsRef<str>>(secrets: &[S]) -> Result<Signer, String> {
        if secrets.is_empty() {
            return Err("signing_secrets is empty".into());
        }
        let keys = secrets
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let raw =
                    decode_secret(s.as_ref()).map_err(|e| format!("signing_secrets[{i}] {e}"))?;
                <Hmac<Sha256> as Mac>::new_from_slice(&raw)
                    .map_err(|e| format!("signing_secrets[{i}]: {e}"))
            })
            .collect::<Result<_, String>>()?;
        Ok(Signer { keys })
    }

    /// `webhook-signature`'s value for `{id}.{timestamp}.{body}`.
    pub fn signature(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        let ts = timestamp.to_string();
        let mut out = String::with_capacity(self.keys.len() * 48);
        for key in &self.keys {
            let mut mac = key.clone();
            for part in [id.as_bytes(), b".", ts.as_bytes(), b".", body] {
                mac.update(part);
            }
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str("v1,");
            STANDARD.encode_string(mac.finalize().into_bytes(), &mut out);
        }
        out
    }

    /// Sets the three headers on a request about to be forwarded at `now`,
    /// replacing any the worker sent. `id` is a dedup key (visible ASCII, SPEC
    /// §6), so every value is a valid header value.
    pub fn sign(
        &self,
        headers: &mut HeaderMap,
        id: &str,
        now: SystemTime,
        body: &[u8],
    ) -> Result<(), String> {
        let ts = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_err(|_| "the clock is before 1970".to_owned())?
            .as_secs();
        let id_value = HeaderValue::from_str(id).map_err(|e| format!("webhook-id: {e}"))?;
        let sig = HeaderValue::from_str(&self.signature(id, ts, body))
            .map_err(|e| format!("webhook-signature: {e}"))?;
        headers.insert(WEBHOOK_ID, id_value);
        headers.insert(WEBHOOK_TIMESTAMP, HeaderValue::from(ts));
        headers.insert(WEBHOOK_SIGNATURE, sig);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The example of the Standard Webhooks spec's reference libraries
    /// (standard-webhooks `libraries/python/tests`): secret, id, timestamp and
    /// payload give this signature. Our own arithmetic is checked against the
    /// receivers' libraries themselves in tests/it/webhooks.rs.
    #[test]
    fn the_reference_example_signs_as_published() {
        let s = Signer::new(&["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]).unwrap();
        assert_eq!(
            s.signature(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1614265330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn two_secrets_give_two_signatures_in_order() {
        let a = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let b = format!("whsec_{}", STANDARD.encode([7u8; 32]));
        let both = Signer::new(&[a, b.as_str()]).unwrap();
        let (one_a, one_b) = (
            Signer::new(&[a]).unwrap().signature("id", 5, b"x"),
            Signer::new(&[b.as_str()]).unwrap().signature("id", 5, b"x"),
        );
        assert_eq!(both.signature("id", 5, b"x"), format!("{one_a} {one_b}"));
    }

    #[test]
    fn headers_are_set_and_replace_the_workers() {
        let s = Signer::new(&["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]).unwrap();
        let mut h = HeaderMap::new();
        h.insert(WEBHOOK_SIGNATURE, HeaderValue::from_static("v1,forged"));
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_614_265_330_999);
        s.sign(
            &mut h,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            at,
            br#"{"test": 2432232314}"#,
        )
        .unwrap();
        assert_eq!(h[WEBHOOK_ID], "msg_p5jXN8AQM9LWM0D4loKWxJek");
        assert_eq!(h[WEBHOOK_TIMESTAMP], "1614265330");
        assert_eq!(
            h.get_all(WEBHOOK_SIGNATURE).iter().collect::<Vec<_>>(),
            ["v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="]
        );
    }

    #[test]
    fn bad_secrets_are_named_by_position_never_quoted() {
        let short = format!("whsec_{}", STANDARD.encode([1u8; 16]));
        for (secrets, needle) in [
            (
                vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "not base64!"],
                "signing_secrets[1] is not whsec_",
            ),
            (vec![short.as_str()], "16 bytes"),
        ] {
            let e = Signer::new(&secrets).unwrap_err();
            assert!(e.contains(needle), "{e}");
            assert!(!e.contains("not base64!") && !e.contains(&short), "{e}");
        }
        assert!(Signer::new::<&str>(&[]).is_err());
        // Without the prefix too, as the receivers' libraries accept.
        assert!(Signer::new(&["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]).is_ok());
    }
}
