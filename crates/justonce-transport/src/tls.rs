//! TLS to a broker, the same for every broker: rustls with the *ring* provider, the broker's
//! certificate checked against the system's trusted roots or the CAs given, and an optional
//! client certificate.
//!
//! ```no_run
//! # fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use justonce_transport::amqp::AmqpOptions;
//! use justonce_transport::tls::Tls;
//!
//! let tls = Tls::default()
//!     .with_ca(std::fs::read("/etc/justonce/broker-ca.pem")?)?
//!     .with_client(
//!         std::fs::read("/etc/justonce/client.pem")?,
//!         std::env::var("BROKER_CLIENT_KEY")?.into_bytes(),
//!     )?;
//! let options = AmqpOptions::new("orders").tls(tls); // with an amqps:// URL
//! # Ok(())
//! # }
//! ```
//!
//! A certificate the handshake refuses (an unknown CA, another host's name, a client
//! certificate the broker does not accept) is an [`Error::Tls`], told apart
//! from a broker that is down, which is an [`Error::Broker`].

use crate::Error;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    AlertDescription, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use std::sync::Arc;

/// How a client checks its broker and proves who it is. The default trusts the system's
/// roots, checks that the broker's certificate names the host of the URL, and sends no
/// client certificate.
#[derive(Clone, Default)]
pub struct Tls {
    /// The trusted CAs, PEM; `None`: the system's roots.
    ca: Option<Vec<u8>>,
    /// The client's certificate chain and private key, PEM.
    client: Option<(Vec<u8>, Vec<u8>)>,
    insecure: bool,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The client key is a secret: only whether there is one is shown.
        f.debug_struct("Tls")
            .field("ca", &self.ca.as_ref().map(|_| "PEM"))
            .field("client_certificate", &self.client.is_some())
            .field("insecure", &self.insecure)
            .finish()
    }
}

impl Tls {
    /// Trusts the CAs in `pem` (one or more PEM certificates) instead of the system's roots.
    pub fn with_ca(mut self, pem: Vec<u8>) -> Result<Self, Error> {
        let certificates = certificates(&pem)
            .map_err(|e| Error::Config(format!("the CA file is not PEM: {e}")))?;
        if certificates.is_empty() {
            return Err(Error::Config(
                "the CA file holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned(),
            ));
        }
        let mut roots = RootCertStore::empty();
        for certificate in certificates {
            roots
                .add(certificate)
                .map_err(|e| Error::Config(format!("the CA file holds a bad certificate: {e}")))?;
        }
        self.ca = Some(pem);
        Ok(self)
    }

    /// Presents the client certificate chain `certificate` (PEM, the client's own first)
    /// with its private key `key` (PEM: PKCS#8, PKCS#1 or SEC1) to brokers that ask for one.
    pub fn with_client(mut self, certificate: Vec<u8>, key: Vec<u8>) -> Result<Self, Error> {
        client_identity(&certificate, &key)?;
        self.client = Some((certificate, key));
        Ok(self)
    }

    /// Checks nothing of the broker's certificate: anyone on the path can read and change
    /// the messages. For a test broker with a certificate of its own; never in production.
    pub fn insecure(mut self) -> Self {
        self.insecure = true;
        self
    }

    /// Whether the broker's certificate goes unchecked (see [`Tls::insecure`]).
    pub fn is_insecure(&self) -> bool {
        self.insecure
    }

    /// The trusted CAs as given, PEM; `None`: the system's roots. For a client that brings
    /// its own TLS (librdkafka's OpenSSL).
    #[cfg(feature = "kafka")]
    pub(crate) fn ca_pem(&self) -> Option<&[u8]> {
        self.ca.as_deref()
    }

    /// The client certificate chain and key as given, PEM.
    #[cfg(feature = "kafka")]
    pub(crate) fn client_pem(&self) -> Option<(&[u8], &[u8])> {
        self.client
            .as_ref()
            .map(|(certificate, key)| (certificate.as_slice(), key.as_slice()))
    }

    /// The rustls configuration of a connection, with the *ring* provider.
    pub fn client_config(&self) -> Result<ClientConfig, Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?;
        let builder = if self.insecure {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerification(
                    provider.signature_verification_algorithms,
                )))
        } else {
            builder.with_root_certificates(self.roots()?)
        };
        match &self.client {
            Some((certificate, key)) => {
                let (chain, key) = client_identity(certificate, key)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::Config(format!("the client certificate cannot be used: {e}"))
                })
            }
            None => Ok(builder.with_no_client_auth()),
        }
    }

    /// The trusted roots: the CAs given, or the system's.
    fn roots(&self) -> Result<RootCertStore, Error> {
        let mut roots = RootCertStore::empty();
        match &self.ca {
            Some(pem) => {
                // Checked when it was set.
                let certificates = certificates(pem).unwrap_or_default();
                roots.add_parsable_certificates(certificates);
            }
            None => {
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
                if roots.is_empty() {
                    return Err(Error::Config(
                        "this system has no trusted root certificates: give the broker's CA file"
                            .to_owned(),
                    ));
                }
            }
        }
        Ok(roots)
    }
}

fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, rustls::pki_types::pem::Error> {
    CertificateDer::pem_slice_iter(pem).collect()
}

/// The client's certificate chain and key, checked to belong together.
fn client_identity(
    certificate: &[u8],
    key: &[u8],
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), Error> {
    let chain = certificates(certificate)
        .map_err(|e| Error::Config(format!("the client certificate file is not PEM: {e}")))?;
    if chain.is_empty() {
        return Err(Error::Config(
            "the client certificate file holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
                .to_owned(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
        Error::Config(format!(
            "the client key holds no PEM private key (-----BEGIN PRIVATE KEY-----): {e}"
        ))
    })?;
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider).map_err(
        |e| match e {
            rustls::Error::InconsistentKeys(_) => {
                Error::Config("the client key does not belong to the client certificate".to_owned())
            }
            e => Error::Config(format!("the client certificate or key cannot be used: {e}")),
        },
    )?;
    Ok((chain, key))
}

/// Why a TLS handshake with a broker failed: a certificate, or a broker that does not
/// speak TLS on that port. Retrying does not help; a setting must change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The broker's certificate is not signed by a trusted CA.
    #[error("the broker's certificate is not signed by a trusted CA")]
    UnknownIssuer,
    /// The broker's certificate does not name the host of the URL.
    #[error("the broker's certificate does not name the host of the URL")]
    WrongHost,
    /// The broker's certificate has expired, or is not valid yet.
    #[error("the broker's certificate has expired or is not valid yet")]
    Expired,
    /// The broker's certificate is refused for another reason.
    #[error("the broker's certificate is refused: {0}")]
    BadCertificate(String),
    /// The broker asks for a client certificate and none is set.
    #[error("the broker asks for a client certificate and none was given")]
    ClientCertificateRequired,
    /// The broker refused the client certificate.
    #[error("the broker refused the client certificate ({0})")]
    ClientCertificateRefused(String),
    /// The handshake failed otherwise: often a port that does not speak TLS.
    #[error("the TLS handshake failed ({0}): is this the broker's TLS port?")]
    Handshake(String),
}

/// A broker error, or a [`TlsError`] if a TLS handshake failed somewhere in its chain of
/// causes.
pub(crate) fn broker_error(error: impl std::error::Error + Send + Sync + 'static) -> Error {
    match tls_error(&error) {
        Some(tls) => Error::Tls(tls),
        None => Error::Broker(Box::new(error)),
    }
}

/// The TLS failure in `error`'s chain of causes, if any. An I/O error is looked into:
/// its `source` skips the error it wraps, which is where TLS libraries put rustls's.
pub(crate) fn tls_error(error: &(dyn std::error::Error + 'static)) -> Option<TlsError> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(TlsError::of(tls));
        }
        if let Some(inner) = error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            && let Some(tls) = tls_error(inner)
        {
            return Some(tls);
        }
        next = error.source();
    }
    None
}

/// Why rustls refuses a handshake with `server` (`host:port`) under `tls`, if it does. For a
/// client whose own TLS library reports only that verification failed (librdkafka's
/// OpenSSL): rustls names the cause. Each step gives up after `timeout`.
#[cfg(feature = "kafka")]
pub(crate) fn handshake_refusal(
    tls: &Tls,
    server: &str,
    timeout: std::time::Duration,
) -> Option<TlsError> {
    use std::net::ToSocketAddrs;
    let (host, port) = server.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let address = (host, port.parse().ok()?).to_socket_addrs().ok()?.next()?;
    let name = ServerName::try_from(host.to_owned()).ok()?;
    let config = Arc::new(tls.client_config().ok()?);
    let mut connection = rustls::ClientConnection::new(config, name).ok()?;
    let mut socket = std::net::TcpStream::connect_timeout(&address, timeout).ok()?;
    socket.set_read_timeout(Some(timeout)).ok()?;
    socket.set_write_timeout(Some(timeout)).ok()?;
    while connection.is_handshaking() {
        if let Err(error) = connection.complete_io(&mut socket) {
            return tls_error(&error);
        }
    }
    None
}

impl TlsError {
    fn of(error: &rustls::Error) -> Self {
        use rustls::CertificateError as Certificate;
        match error {
            rustls::Error::InvalidCertificate(certificate) => match certificate {
                Certificate::UnknownIssuer | Certificate::BadSignature => TlsError::UnknownIssuer,
                Certificate::NotValidForName | Certificate::NotValidForNameContext { .. } => {
                    TlsError::WrongHost
                }
                Certificate::Expired
                | Certificate::ExpiredContext { .. }
                | Certificate::NotValidYet
                | Certificate::NotValidYetContext { .. } => TlsError::Expired,
                other => TlsError::BadCertificate(format!("{other:?}")),
            },
            rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => {
                TlsError::ClientCertificateRequired
            }
            rustls::Error::AlertReceived(
                alert @ (AlertDescription::BadCertificate
                | AlertDescription::UnsupportedCertificate
                | AlertDescription::CertificateRevoked
                | AlertDescription::CertificateExpired
                | AlertDescription::CertificateUnknown
                | AlertDescription::UnknownCA
                | AlertDescription::AccessDenied),
            ) => TlsError::ClientCertificateRefused(format!("{alert:?}")),
            other => TlsError::Handshake(other.to_string()),
        }
    }
}

/// Accepts any certificate of the broker; still checks that the handshake is signed by the
/// certificate's key, as rustls requires of a verifier.
#[derive(Debug)]
struct NoVerification(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}
