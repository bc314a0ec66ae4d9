//! How a connection to a database server is secured: what a URL that does not say gets,
//! the warning for one that turns verification off, and what a failed handshake means.
//!
//! The rule: a server reached over the network is verified (`verify-full`) unless the URL
//! says otherwise, and a URL that names a weaker mode logs a warning at connect saying
//! what goes unchecked. A server on this machine (loopback or a Unix socket) keeps the
//! driver's default, `prefer`: nothing crosses a network there.

use justonce_core::Error;
use sqlx::ConnectOptions;
use std::net::IpAddr;
use std::time::Duration;

/// What one database's URL calls its TLS settings, and what its server says when it wants
/// TLS that the client turned off.
pub(crate) struct Dialect {
    /// The database, as messages name it.
    pub(crate) name: &'static str,
    /// The parameter that chooses the mode, first the name the docs use.
    pub(crate) mode: &'static [&'static str],
    /// The mode that verifies the certificate and the host name.
    pub(crate) verify_full: &'static str,
    /// The mode that turns TLS off.
    pub(crate) disable: &'static str,
    /// The parameter naming the CA file, first the name the docs use.
    pub(crate) ca: &'static [&'static str],
    /// The parameters naming the client certificate and its key.
    pub(crate) client: [&'static [&'static str]; 2],
    /// How much each mode protects, by its lower-case name.
    pub(crate) protection: fn(&str) -> Option<Protection>,
    /// Whether the server's refusal of a plain-text connection may be for want of TLS.
    pub(crate) refused_plain_text: fn(&dyn sqlx::error::DatabaseError) -> bool,
    /// Whether the server refused the connection for want of a client certificate.
    pub(crate) wants_client_certificate: fn(&dyn sqlx::error::DatabaseError) -> bool,
}

/// How much a TLS mode protects, weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Protection {
    /// No TLS.
    Plain,
    /// TLS when the server offers it, unverified.
    Opportunistic,
    /// TLS, whoever the server is.
    Unverified,
    /// TLS to a server with a certificate from the CA, for any host name.
    CaOnly,
    /// TLS to this host, with a certificate from the CA.
    Full,
}

/// One database URL, read for its TLS settings.
pub(crate) struct Target<O> {
    /// The driver's options, with the default mode applied.
    pub(crate) options: O,
    /// The URL without its password, as messages name the database.
    shown: String,
    /// The host the certificate must name.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    host: String,
    /// The CA file the URL names, if it does.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    ca_file: Option<String>,
    /// The mode as the URL (or the driver's environment variable) gives it, if it does.
    explicit: Option<(String, Protection)>,
    protection: Protection,
    dialect: &'static Dialect,
}

/// The options sqlx reads from a URL, as far as TLS needs them.
pub(crate) trait TlsOptions: ConnectOptions + Sized {
    /// The host name, or a socket path.
    fn host(&self) -> &str;
    /// Whether the URL names a Unix socket.
    fn is_socket(&self) -> bool;
    /// The same options verifying the certificate and the host name.
    fn verify_full(self) -> Self;
    /// The environment variable that sets the mode when the URL does not, if any.
    const MODE_VARIABLE: Option<&'static str>;
}

impl<O: TlsOptions> Target<O> {
    /// Reads `url`; a URL or TLS file the driver cannot use is a configuration error.
    pub(crate) fn parse(url: &str, dialect: &'static Dialect) -> Result<Self, Error> {
        let parsed = url::Url::parse(url)
            .map_err(|e| Error::Config(format!("{} URL: {e}", dialect.name)))?;
        let shown = without_password(&parsed);
        let unusable = |problem: String| Error::Config(format!("database {shown}: {problem}"));
        let parameter = |names: &[&str]| {
            parsed
                .query_pairs()
                .find(|(name, _)| names.contains(&name.as_ref()))
                .map(|(_, value)| value.into_owned())
        };
        for names in [dialect.ca, dialect.client[0], dialect.client[1]] {
            if let Some(file) = parameter(names)
                && !file.trim_start().starts_with("-----BEGIN")
                && let Err(error) = std::fs::File::open(&file)
            {
                return Err(unusable(format!(
                    "{}: cannot read {file}: {error}",
                    names[0]
                )));
            }
        }
        let mode = parameter(dialect.mode)
            .or_else(|| O::MODE_VARIABLE.and_then(|variable| std::env::var(variable).ok()));
        let explicit = match mode {
            Some(mode) => match (dialect.protection)(&mode.to_ascii_lowercase()) {
                Some(protection) => Some((mode, protection)),
                None => {
                    return Err(unusable(format!(
                        "{}={mode} is not a mode this driver knows",
                        dialect.mode[0]
                    )));
                }
            },
            None => None,
        };
        let options = O::from_url(&parsed).map_err(|e| unusable(e.to_string()))?;
        let local = options.is_socket() || is_local(options.host());
        let (options, protection) = match &explicit {
            Some((_, protection)) => (options, *protection),
            None if local => (options, Protection::Opportunistic),
            None => (options.verify_full(), Protection::Full),
        };
        if protection > Protection::Opportunistic && !cfg!(feature = "tls") {
            return Err(unusable(format!(
                "TLS is required ({}), but justonce-sql was built without its `tls` feature; \
                 enable it, or write {}={} where the network to the server is private",
                mode_said(&explicit, dialect),
                dialect.mode[0],
                dialect.disable
            )));
        }
        let host = options.host().to_owned();
        let target = Self {
            options,
            shown,
            host,
            ca_file: parameter(dialect.ca).map(|ca| {
                match ca.trim_start().starts_with("-----BEGIN") {
                    true => "given inline".to_owned(),
                    false => ca,
                }
            }),
            explicit,
            protection,
            dialect,
        };
        target.warn_if_unverified();
        Ok(target)
    }

    /// One warning at connect when the URL names a mode weaker than full verification.
    fn warn_if_unverified(&self) {
        let Some((mode, protection)) = &self.explicit else {
            return;
        };
        let risk = match protection {
            Protection::Plain => {
                "connects in plain text: passwords and data cross the network unencrypted"
            }
            Protection::Opportunistic => {
                "connects in plain text when the server offers no TLS, and never verifies the server's certificate"
            }
            Protection::Unverified => {
                "does not verify the server's certificate: anyone on the network path can pose as the server"
            }
            Protection::CaOnly => {
                "does not check the host name in the server's certificate: any server with a certificate from that CA can pose as this one"
            }
            Protection::Full => return,
        };
        tracing::warn!(
            database = %self.shown,
            "{}={mode} {risk}; {}={} verifies",
            self.dialect.mode[0],
            self.dialect.mode[0],
            self.dialect.verify_full
        );
    }

    /// Opens a pool on these options. sqlx retries a refused connection until the pool's
    /// acquire timeout and then says only that it timed out: one direct attempt, of a
    /// second at most so that the whole wait stays near the timeout, then tells why, such
    /// as the refusal itself. A server that answers that attempt came up meanwhile: the
    /// pool is opened again.
    pub(crate) async fn connect_pool<DB>(
        &self,
        pool: sqlx::pool::PoolOptions<DB>,
        database: fn(sqlx::Error) -> Error,
    ) -> Result<sqlx::Pool<DB>, Error>
    where
        DB: sqlx::Database,
        DB::Connection: sqlx::Connection<Options = O>,
    {
        let timeout = pool.get_acquire_timeout();
        let diagnosis = timeout.min(Duration::from_secs(1));
        let error = match pool.clone().connect_with(self.options.clone()).await {
            Ok(pool) => return Ok(pool),
            Err(sqlx::Error::PoolTimedOut) => {
                let attempt = <DB::Connection as sqlx::Connection>::connect_with(&self.options);
                match tokio::time::timeout(diagnosis, attempt).await {
                    Ok(Err(error)) => error,
                    Ok(Ok(connection)) => {
                        let _ = sqlx::Connection::close(connection).await;
                        match pool.connect_with(self.options.clone()).await {
                            Ok(pool) => return Ok(pool),
                            Err(error) => error,
                        }
                    }
                    Err(_) => sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no answer within {} ms", timeout.as_millis()),
                    )),
                }
            }
            Err(error) => error,
        };
        Err(self.connect_error(error, database))
    }

    /// The error of a failed first connection: a TLS or certificate problem, or a server
    /// that wants the TLS the URL turned off, is a configuration error in plain words that
    /// names the database; anything else stays a database error.
    pub(crate) fn connect_error(
        &self,
        error: sqlx::Error,
        database: fn(sqlx::Error) -> Error,
    ) -> Error {
        match self.problem(&error) {
            Some(problem) => Error::Config(format!("database {}: {problem}", self.shown)),
            None => database(error),
        }
    }

    fn problem(&self, error: &sqlx::Error) -> Option<String> {
        let d = self.dialect;
        match error {
            sqlx::Error::Configuration(problem) => Some(problem.to_string()),
            sqlx::Error::Database(error)
                if self.protection == Protection::Plain
                    && (d.refused_plain_text)(error.as_ref()) =>
            {
                Some(format!(
                    "the server refused a plain-text connection ({}); a server that requires \
                     TLS does so, and {} turns TLS off: write {}={} with {}=FILE, the CA that \
                     signed the server's certificate",
                    error.message(),
                    mode_said(&self.explicit, d),
                    d.mode[0],
                    d.verify_full,
                    d.ca[0]
                ))
            }
            sqlx::Error::Database(error) if (d.wants_client_certificate)(error.as_ref()) => {
                Some(format!(
                    "the server requires a client certificate ({}); set {}=FILE and {}=FILE",
                    error.message(),
                    d.client[0][0],
                    d.client[1][0]
                ))
            }
            sqlx::Error::Tls(inner) => Some(match self.handshake_problem(inner.as_ref()) {
                Some(problem) => problem,
                None if inner.to_string().contains("does not support TLS") => format!(
                    "the server does not offer TLS, and {} requires it; turn TLS on at the \
                     server, or write {}={} where the network to it is private",
                    mode_said(&self.explicit, d),
                    d.mode[0],
                    d.disable
                ),
                None => format!("TLS failed: {inner}"),
            }),
            sqlx::Error::Io(io) => self.handshake_problem(io.get_ref()?),
            _ => None,
        }
    }

    #[cfg(feature = "tls")]
    fn certificate_problem(&self, error: &rustls::Error) -> String {
        use rustls::{AlertDescription as Alert, CertificateError as Certificate};
        let d = self.dialect;
        let ca = d.ca[0];
        let host = &self.host;
        let hint = if self.protection == Protection::CaOnly {
            ""
        } else {
            " (or connect by a name it holds)"
        };
        match error {
            rustls::Error::InvalidCertificate(Certificate::UnknownIssuer) => match &self.ca_file {
                Some(file) => format!(
                    "the server's certificate is signed by an unknown certificate authority: \
                     not the one in {ca} ({file}), nor one this system trusts"
                ),
                None => format!(
                    "the server's certificate is signed by a certificate authority this system \
                     does not trust; set {ca}=FILE to the CA that signed it"
                ),
            },
            rustls::Error::InvalidCertificate(Certificate::NotValidForNameContext {
                presented,
                ..
            }) => format!(
                "the server's certificate does not name the host {host}: it names {}{hint}",
                presented
                    .iter()
                    .map(|name| plain_name(name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            rustls::Error::InvalidCertificate(Certificate::NotValidForName) => {
                format!("the server's certificate does not name the host {host}{hint}")
            }
            rustls::Error::InvalidCertificate(
                Certificate::Expired | Certificate::ExpiredContext { .. },
            ) => "the server's certificate has expired".to_owned(),
            rustls::Error::InvalidCertificate(
                Certificate::NotValidYet | Certificate::NotValidYetContext { .. },
            ) => "the server's certificate is not valid yet".to_owned(),
            rustls::Error::InvalidCertificate(Certificate::Revoked) => {
                "the server's certificate is revoked".to_owned()
            }
            rustls::Error::InvalidCertificate(other) => {
                format!("the server's certificate is refused: {other:?}")
            }
            rustls::Error::AlertReceived(
                Alert::CertificateRequired
                | Alert::BadCertificate
                | Alert::UnknownCA
                | Alert::CertificateUnknown
                | Alert::CertificateExpired
                | Alert::AccessDenied,
            ) => format!(
                "the server refused the client certificate; check {} and {}",
                d.client[0][0], d.client[1][0]
            ),
            other => format!("the TLS handshake failed: {other}"),
        }
    }

    /// What a failed handshake means, when rustls gave the error.
    #[cfg(feature = "tls")]
    fn handshake_problem(
        &self,
        error: &(dyn std::error::Error + Send + Sync + 'static),
    ) -> Option<String> {
        let error = error.downcast_ref::<rustls::Error>()?;
        Some(self.certificate_problem(error))
    }

    /// Without TLS there is no handshake.
    #[cfg(not(feature = "tls"))]
    fn handshake_problem(
        &self,
        _error: &(dyn std::error::Error + Send + Sync + 'static),
    ) -> Option<String> {
        None
    }
}

/// A name as webpki presents it (`DnsName("db.example.com")`, `IpAddress(10.0.0.5)`),
/// without its wrapping.
#[cfg(feature = "tls")]
fn plain_name(presented: &str) -> &str {
    ["DnsName(\"", "IpAddress("]
        .iter()
        .find_map(|wrapping| presented.strip_prefix(wrapping))
        .map_or(presented, |name| {
            name.trim_end_matches(')').trim_end_matches('"')
        })
}

/// `sslmode=require`, or `no sslmode` for the default.
fn mode_said(explicit: &Option<(String, Protection)>, dialect: &Dialect) -> String {
    match explicit {
        Some((mode, _)) => format!("{}={mode}", dialect.mode[0]),
        None => format!(
            "{}={} (the default for a remote server)",
            dialect.mode[0], dialect.verify_full
        ),
    }
}

/// Whether `host` is this machine: `localhost`, a loopback address, or a socket folder.
fn is_local(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The URL as messages show it: no password, in the userinfo or as a parameter.
fn without_password(url: &url::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_password(None);
    if let Some(query) = url.query() {
        let kept: Vec<&str> = query
            .split('&')
            .filter(|pair| !pair.starts_with("password="))
            .collect();
        let kept = kept.join("&");
        shown.set_query(Some(kept.as_str()).filter(|query| !query.is_empty()));
    }
    shown.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_hosts() {
        for host in [
            "localhost",
            "127.0.0.1",
            "127.1.2.3",
            "[::1]",
            "/var/run/postgresql",
        ] {
            assert!(is_local(host), "{host}");
        }
        for host in [
            "db.example.com",
            "10.0.0.5",
            "localhost.example.com",
            "[2001:db8::1]",
        ] {
            assert!(!is_local(host), "{host}");
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn presented_names_lose_their_wrapping() {
        assert_eq!(plain_name("DnsName(\"db.example.com\")"), "db.example.com");
        assert_eq!(plain_name("IpAddress(10.0.0.5)"), "10.0.0.5");
        assert_eq!(plain_name("DirectoryName"), "DirectoryName");
    }

    #[test]
    fn messages_show_no_password() {
        let url = url::Url::parse(
            "postgres://app:hunter2@db.example.com/app?sslmode=require&password=hunter2",
        )
        .unwrap();
        assert_eq!(
            without_password(&url),
            "postgres://app@db.example.com/app?sslmode=require"
        );
    }
}
