//! A route's TLS client certificate (SPEC §9 `client_cert`, `client_key`): what
//! an https upstream that demands one (mutual TLS) is shown. Read from PEM files
//! when the config is loaded and on every reload, so a renewed certificate is
//! picked up by SIGHUP; checked then that the key belongs to the certificate,
//! so a mismatch is a config error (`check-config` exit 2), not a 502 later.
//! The key is never logged: errors name files, never their contents.

use std::path::Path;

use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A certificate chain and its private key, checked to match.
pub struct Identity {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identity({} certificates, key hidden)", self.certs.len())
    }
}

impl Identity {
    /// Reads `cert` (PEM chain, end-entity first) and `key` (PEM: PKCS#8,
    /// PKCS#1 or SEC1) and checks that the key is the certificate's.
    pub fn load(cert: &Path, key: &Path) -> Result<Identity, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .map_err(|e| format!("client_cert {}: {}", cert.display(), pem_error(&e)))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("client_cert {}: {}", cert.display(), pem_error(&e)))?;
        if certs.is_empty() {
            return Err(format!(
                "client_cert {} holds no PEM certificate",
                cert.display()
            ));
        }
        let key_der = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("client_key {}: {}", key.display(), pem_error(&e)))?;
        let provider = rustls::crypto::ring::default_provider();
        CertifiedKey::from_der(certs.clone(), key_der.clone_key(), &provider).map_err(
            |e| match e {
                rustls::Error::InconsistentKeys(_) => format!(
                    "client_key {} is not the key of client_cert {}",
                    key.display(),
                    cert.display()
                ),
                other => format!(
                    "client_key {} cannot sign for client_cert {}: {other}",
                    key.display(),
                    cert.display()
                ),
            },
        )?;
        Ok(Identity {
            certs,
            key: key_der,
        })
    }

    /// Completes a client config with this identity.
    pub(super) fn apply(
        &self,
        builder: rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert>,
    ) -> Result<rustls::ClientConfig, String> {
        builder
            .with_client_auth_cert(self.certs.clone(), self.key.clone_key())
            .map_err(|e| format!("client certificate: {e}"))
    }
}

/// How an upstream exchange that ended in a TLS alert about the client
/// certificate is read (SPEC §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertRefusal {
    /// `certificate_required`: the server wanted a certificate and the client
    /// showed none. RFC 8446 §4.4.2.4 has a server send it only while it judges
    /// the handshake, so the server never accepted the connection and nothing of
    /// the request was acted upon: SPEC §6's "no byte sent" (502, the key freed).
    NoneShown,
    /// Any other alert about a certificate or the handshake. With TLS 1.3 the
    /// client's side of the handshake is over, and the request written, before
    /// the server has checked the certificate; but a server may send these alerts
    /// later too (after reading the request, even after answering it), so the
    /// outcome is unknown: in doubt (504), its cause named.
    Refused,
}

impl CertRefusal {
    /// The cause in words, for the detail, the warn line and the access line.
    pub fn why(self) -> &'static str {
        match self {
            CertRefusal::NoneShown => {
                "the upstream requires a TLS client certificate and none was shown (set the route's client_cert and client_key)"
            }
            CertRefusal::Refused => {
                "the upstream sent a TLS alert refusing the client certificate (client_cert) or the handshake; it may have read the request first"
            }
        }
    }
}

/// Whether an upstream exchange failed on a TLS alert about the client
/// certificate, and which ([`CertRefusal`]).
pub fn handshake_refused(e: &(dyn std::error::Error + 'static)) -> Option<CertRefusal> {
    use rustls::AlertDescription as A;
    let mut cur = Some(e);
    while let Some(err) = cur {
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::AlertReceived(alert)) = tls {
            return match alert {
                A::CertificateRequired => Some(CertRefusal::NoneShown),
                A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::AccessDenied
                | A::DecryptError
                | A::HandshakeFailure => Some(CertRefusal::Refused),
                _ => None,
            };
        }
        cur = err.source();
    }
    None
}

/// A PEM reading error in words: never the file's bytes.
fn pem_error(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error;
    match e {
        Error::Io(io) => io.to_string(),
        Error::NoItemsFound => "no PEM item of the expected kind".into(),
        Error::MissingSectionEnd { .. } | Error::IllegalSectionStart { .. } => {
            "malformed PEM section".into()
        }
        Error::Base64Decode(_) => "malformed base64 in a PEM section".into(),
        _ => "unreadable PEM".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(dir: &Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf, String) {
        let ck = rcgen::generate_simple_self_signed(vec!["client.test".into()]).unwrap();
        let (c, k) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, ck.cert.pem()).unwrap();
        let key_pem = ck.signing_key.serialize_pem();
        std::fs::write(&k, &key_pem).unwrap();
        (c, k, key_pem)
    }

    #[test]
    fn a_refused_client_certificate_is_told_from_other_failures() {
        let wrapped = |alert| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::AlertReceived(alert),
            )
        };
        let e = wrapped(rustls::AlertDescription::CertificateRequired);
        assert_eq!(handshake_refused(&e), Some(CertRefusal::NoneShown));
        let e = wrapped(rustls::AlertDescription::UnknownCA);
        assert_eq!(handshake_refused(&e), Some(CertRefusal::Refused));
        for other in [
            wrapped(rustls::AlertDescription::CloseNotify),
            wrapped(rustls::AlertDescription::InternalError),
            std::io::Error::from(std::io::ErrorKind::ConnectionReset),
        ] {
            assert_eq!(handshake_refused(&other), None, "{other}");
        }
    }

    #[test]
    fn a_matching_pair_loads_and_a_mismatch_or_missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let (c1, k1, key_pem) = pair(dir.path(), "one");
        let (_c2, k2, _) = pair(dir.path(), "two");
        let id = Identity::load(&c1, &k1).unwrap();
        assert!(!format!("{id:?}").contains("PRIVATE"));
        let e = Identity::load(&c1, &k2).unwrap_err();
        assert!(e.contains("is not the key of client_cert"), "{e}");
        assert!(e.contains("two.key") && e.contains("one.crt"), "{e}");
        let e = Identity::load(&dir.path().join("gone.crt"), &k1).unwrap_err();
        assert!(e.contains("gone.crt"), "{e}");
        let e = Identity::load(&c1, &dir.path().join("gone.key")).unwrap_err();
        assert!(e.contains("gone.key"), "{e}");
        // A key file given as the certificate: named, and its contents not shown.
        let e = Identity::load(&k1, &k1).unwrap_err();
        assert!(
            e.contains("one.key") && !e.contains(&key_pem[30..60]),
            "{e}"
        );
    }
}
