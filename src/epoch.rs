//! The vocabulary of SPEC §2: lease names, epochs, tokens and the epoch object.
//!
//! Everything here is pure: parsing and formatting, no I/O. Invalid values cannot
//! be constructed, so the rest of the crate never re-validates them.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A leadership generation. `Epoch(0)` means "none yet": no epoch object has number 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Epoch(u64);

impl Epoch {
    /// "No epoch yet": the mark of a lease never admitted, below every real epoch.
    pub const NONE: Epoch = Epoch(0);

    /// The epoch numbered `n` (as in the object's key).
    pub const fn new(n: u64) -> Epoch {
        Epoch(n)
    }

    /// The epoch's number, for keys, headers and storage.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The next epoch, or `None` at `u64::MAX` (no successor can ever be created).
    pub fn next(self) -> Option<Epoch> {
        self.0.checked_add(1).map(Epoch)
    }

    /// Parses an `X-Lease-Epoch` value: a plain decimal u64 in its one
    /// spelling — ASCII digits only, no sign, no spaces, no empty value, no
    /// leading zero (SPEC §3: `007` is refused, not read as 7: the header goes
    /// on to the destination as sent, and one epoch has one spelling there).
    pub fn parse_header(raw: &[u8]) -> Option<Epoch> {
        if raw.len() > 1 && raw[0] == b'0' {
            return None;
        }
        Epoch::parse_digits(raw)
    }

    /// Up to 20 ASCII digits as a u64, leading zeros allowed (object keys).
    fn parse_digits(raw: &[u8]) -> Option<Epoch> {
        if raw.is_empty() || raw.len() > 20 || !raw.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let mut n: u64 = 0;
        for &b in raw {
            n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
        }
        Some(Epoch(n))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A lease name: `[a-z0-9][a-z0-9._-]{0,62}` (SPEC §2). Safe as an S3 key segment
/// and as a file name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseName(String);

impl LeaseName {
    /// Validates a lease name from config, a header or a key; the error says why.
    pub fn parse(s: &str) -> Result<LeaseName, String> {
        let b = s.as_bytes();
        let ok_first = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        let ok_rest = |c: u8| ok_first(c) || c == b'.' || c == b'_' || c == b'-';
        if b.is_empty() || b.len() > 63 || !ok_first(b[0]) || !b[1..].iter().all(|&c| ok_rest(c)) {
            return Err(format!(
                "invalid lease name {s:?}: must match [a-z0-9][a-z0-9._-]{{0,62}}"
            ));
        }
        Ok(LeaseName(s.to_owned()))
    }

    /// The name, as used in object keys and file names.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LeaseName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for LeaseName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        LeaseName::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// SHA-256 of a lease token's bytes, exactly as sent in `X-Lease-Token`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenHash([u8; 32]);

impl TokenHash {
    /// Hashes a token as the worker sends it (admission rule 2).
    pub fn of(token: &[u8]) -> TokenHash {
        TokenHash(Sha256::digest(token).into())
    }

    /// Parses lowercase hex (the `token_sha256` field).
    pub fn from_hex(s: &str) -> Option<TokenHash> {
        if s.len() != 64 || s.bytes().any(|c| c.is_ascii_uppercase()) {
            return None;
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(TokenHash(out))
    }

    /// Lowercase hex, as written in `token_sha256`.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Constant-time comparison: a token check must not leak how many bytes matched.
    pub fn matches(&self, other: &TokenHash) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenHash({}…)", &self.to_hex()[..8])
    }
}

/// The `kind` field of an epoch object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EpochKind {
    /// Starts a tenure: carries a token hash and a TTL.
    Acquire,
    /// Ends a tenure voluntarily, so a contender need not wait for expiry.
    Release,
}

/// The JSON body of an epoch object, as written and read (SPEC §2). Unknown fields
/// are ignored when reading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Format version; 1.
    pub v: u32,
    /// The lease; must match the object's key.
    pub lease: String,
    /// The epoch number; must match the object's key.
    pub epoch: u64,
    /// Acquire or release.
    pub kind: EpochKind,
    /// Free text naming the holder, for operators.
    pub holder: String,
    /// Acquire only: lowercase hex SHA-256 of the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_sha256: Option<String>,
    /// Acquire only: the tenure's length from `LastModified`, on the store's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Gate objects only (SPEC §10.2): how peers reach the holder's proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Gate objects only: `"single"` or `"cluster"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Gate objects only: the shard count of the holder's set-up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<u32>,
    /// Gate objects only: where the holder keeps marks and dedup records
    /// (`sled:{instance id}`, `postgres://host:port/db`): two instances share
    /// deliveries only if they name the same state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Gate objects of a single instance only (SPEC §10.1): the process that
    /// wrote it. Its own instance id takes the gate back at once only from a
    /// process provably gone; an object without it (an older fencegate) is no
    /// proof.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<crate::process::ProcessId>,
    /// Gate objects only (SPEC §10, "Identity and generations"): the
    /// generation its writer's state had recorded, durably, before the
    /// object was written; a state that finds a higher one of its own is a
    /// copy or a restored backup ([`crate::state::identity`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_generation: Option<u64>,
    /// A cluster's gate objects only: HMAC-SHA256 over the fields above, keyed
    /// by the peer token ([`crate::set_up::GateKey`]), hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl EpochRecord {
    /// The body of an acquire of `epoch` with `token`, valid for `ttl`.
    pub fn acquire(
        lease: &LeaseName,
        epoch: Epoch,
        holder: &str,
        token: &[u8],
        ttl: Duration,
    ) -> Self {
        EpochRecord {
            v: 1,
            lease: lease.as_str().to_owned(),
            epoch: epoch.get(),
            kind: EpochKind::Acquire,
            holder: holder.to_owned(),
            token_sha256: Some(TokenHash::of(token).to_hex()),
            ttl_ms: Some(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
            advertise: None,
            mode: None,
            shards: None,
            state: None,
            process: None,
            state_generation: None,
            mac: None,
        }
    }

    /// The body of a release of `epoch`.
    pub fn release(lease: &LeaseName, epoch: Epoch, holder: &str) -> Self {
        EpochRecord {
            v: 1,
            lease: lease.as_str().to_owned(),
            epoch: epoch.get(),
            kind: EpochKind::Release,
            holder: holder.to_owned(),
            token_sha256: None,
            ttl_ms: None,
            advertise: None,
            mode: None,
            shards: None,
            state: None,
            process: None,
            state_generation: None,
            mac: None,
        }
    }

    /// The body as stored.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing a struct of strings and integers cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// What an epoch object means to admission, decided once when it is read and then
/// cached forever (objects are immutable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EpochObject {
    /// A valid acquire: admits requests carrying the token until `expires_at` on the
    /// store's clock.
    Acquire {
        /// Who acquired it.
        holder: String,
        /// The token's hash, checked against each request's token.
        token: TokenHash,
        /// `LastModified + ttl_ms`, on the store's clock (rule 4).
        expires_at: SystemTime,
    },
    /// A voluntary release: ends the previous tenure, admits nothing.
    Release {
        /// Who released it.
        holder: String,
    },
    /// Exists (so it makes older epochs stale) but admits nothing.
    Invalid {
        /// Why it admits nothing (unparsable, disagrees with its key, …).
        reason: String,
    },
}

impl EpochObject {
    /// Interprets a stored object found at the key of (`lease`, `epoch`).
    pub fn from_stored(
        lease: &LeaseName,
        epoch: Epoch,
        body: &[u8],
        last_modified: SystemTime,
    ) -> EpochObject {
        let invalid = |reason: String| EpochObject::Invalid { reason };
        let rec: EpochRecord = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return invalid(format!("epoch object does not parse: {e}")),
        };
        if rec.v != 1 {
            return invalid(format!("unsupported format version {}", rec.v));
        }
        if rec.lease != lease.as_str() || rec.epoch != epoch.get() {
            return invalid(format!(
                "object names lease {:?} epoch {}, but its key is lease {:?} epoch {}",
                rec.lease,
                rec.epoch,
                lease.as_str(),
                epoch
            ));
        }
        match rec.kind {
            EpochKind::Release => EpochObject::Release { holder: rec.holder },
            EpochKind::Acquire => {
                let Some(token) = rec.token_sha256.as_deref().and_then(TokenHash::from_hex) else {
                    return invalid("acquire without a valid token_sha256".into());
                };
                let Some(ttl) = rec.ttl_ms else {
                    return invalid("acquire without ttl_ms".into());
                };
                let expires_at = last_modified
                    .checked_add(Duration::from_millis(ttl))
                    .unwrap_or(
                        SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(u32::MAX) * 16),
                    );
                EpochObject::Acquire {
                    holder: rec.holder,
                    token,
                    expires_at,
                }
            }
        }
    }

    /// The holder named in the object, unless it is invalid.
    pub fn holder(&self) -> Option<&str> {
        match self {
            EpochObject::Acquire { holder, .. } | EpochObject::Release { holder } => Some(holder),
            EpochObject::Invalid { .. } => None,
        }
    }
}

/// The prefix under which a lease's epoch objects live: `{prefix}{lease}/`.
pub fn lease_prefix(prefix: &str, lease: &LeaseName) -> String {
    format!("{prefix}{lease}/")
}

/// The key of one epoch object: `{prefix}{lease}/{epoch:020}.json`.
pub fn object_key(prefix: &str, lease: &LeaseName, epoch: Epoch) -> String {
    format!("{prefix}{lease}/{:020}.json", epoch.get())
}

/// Recovers the epoch from a key listed under `lease_prefix`; other keys give `None`.
pub fn epoch_of_key(lease_prefix: &str, key: &str) -> Option<Epoch> {
    let rest = key.strip_prefix(lease_prefix)?;
    let digits = rest.strip_suffix(".json")?;
    if digits.len() != 20 {
        return None;
    }
    Epoch::parse_digits(digits.as_bytes()).filter(|e| *e != Epoch::NONE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_header_accepts_plain_decimal_only() {
        assert_eq!(Epoch::parse_header(b"7"), Some(Epoch(7)));
        assert_eq!(Epoch::parse_header(b"0"), Some(Epoch(0)));
        assert_eq!(
            Epoch::parse_header(b"18446744073709551615"),
            Some(Epoch(u64::MAX))
        );
        for bad in [
            &b""[..],
            b"18446744073709551616",
            b"+7",
            b"-1",
            b" 7",
            b"7 ",
            b"0x7",
            b"7.0",
            b"1e3",
            b"\xd9\xa7",
            b"0007",
            b"01",
            b"00",
        ] {
            assert_eq!(Epoch::parse_header(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn lease_names_follow_the_spec_pattern() {
        for ok in ["billing", "a", "0", "a.b_c-d", &"x".repeat(63)] {
            assert!(LeaseName::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Billing",
            "-a",
            ".a",
            "a/b",
            "a b",
            &"x".repeat(64),
            "é",
        ] {
            assert!(LeaseName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn key_layout_matches_spec_example() {
        let lease = LeaseName::parse("billing").unwrap();
        let key = object_key("fencegate/", &lease, Epoch(7));
        assert_eq!(key, "fencegate/billing/00000000000000000007.json");
        assert_eq!(
            epoch_of_key(&lease_prefix("fencegate/", &lease), &key),
            Some(Epoch(7))
        );
        assert_eq!(
            epoch_of_key("fencegate/billing/", "fencegate/billing/7.json"),
            None
        );
        assert_eq!(
            epoch_of_key(
                "fencegate/billing/",
                "fencegate/billing/00000000000000000007.tmp"
            ),
            None
        );
    }

    #[test]
    fn objects_are_interpreted_strictly() {
        let lease = LeaseName::parse("billing").unwrap();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let rec = EpochRecord::acquire(&lease, Epoch(3), "w1", b"tok", Duration::from_millis(500));
        let obj = EpochObject::from_stored(&lease, Epoch(3), &rec.to_json(), t0);
        assert_eq!(
            obj,
            EpochObject::Acquire {
                holder: "w1".into(),
                token: TokenHash::of(b"tok"),
                expires_at: t0 + Duration::from_millis(500)
            }
        );
        // Key and body disagree: still an epoch, admits nothing.
        let other = EpochObject::from_stored(&lease, Epoch(4), &rec.to_json(), t0);
        assert!(matches!(other, EpochObject::Invalid { .. }));
        assert!(matches!(
            EpochObject::from_stored(&lease, Epoch(3), b"{not json", t0),
            EpochObject::Invalid { .. }
        ));
        // Unknown fields are ignored.
        let extra =
            br#"{"v":1,"lease":"billing","epoch":3,"kind":"release","holder":"w1","future":true}"#;
        assert_eq!(
            EpochObject::from_stored(&lease, Epoch(3), extra, t0),
            EpochObject::Release {
                holder: "w1".into()
            }
        );
    }

    #[test]
    fn token_hash_hex_round_trip() {
        let h = TokenHash::of(b"secret");
        assert_eq!(TokenHash::from_hex(&h.to_hex()), Some(h));
        assert!(TokenHash::from_hex(&h.to_hex().to_uppercase()).is_none());
        assert!(h.matches(&TokenHash::of(b"secret")));
        assert!(!h.matches(&TokenHash::of(b"secreT")));
    }
}
