//! PostgreSQL's names for its TLS settings, and what its server says when it wants TLS.

use crate::tls::{Dialect, Protection, TlsOptions};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// libpq's names for PostgreSQL's TLS settings, as sqlx reads them.
pub(super) static TLS: Dialect = Dialect {
    name: "PostgreSQL",
    mode: &["sslmode", "ssl-mode"],
    verify_full: "verify-full",
    disable: "disable",
    ca: &["sslrootcert", "ssl-root-cert", "ssl-ca"],
    client: [&["sslcert", "ssl-cert"], &["sslkey", "ssl-key"]],
    protection: |mode| match mode {
        // sqlx connects in plain text for `allow`.
        "disable" | "allow" => Some(Protection::Plain),
        "prefer" => Some(Protection::Opportunistic),
        "require" => Some(Protection::Unverified),
        "verify-ca" => Some(Protection::CaOnly),
        "verify-full" => Some(Protection::Full),
        _ => None,
    },
    // 28000 invalid_authorization_specification: no pg_hba.conf line lets a connection
    // without encryption in ("no encryption"; "SSL off" before PostgreSQL 14).
    refused_plain_text: |error| {
        error.code().as_deref() == Some("28000")
            && (error.message().contains("no encryption") || error.message().contains("SSL off"))
    },
    wants_client_certificate: |error| {
        error.code().as_deref() == Some("28000")
            && error
                .message()
                .contains("requires a valid client certificate")
    },
};

impl TlsOptions for PgConnectOptions {
    const MODE_VARIABLE: Option<&'static str> = Some("PGSSLMODE");

    fn host(&self) -> &str {
        self.get_host()
    }

    fn is_socket(&self) -> bool {
        self.get_socket().is_some()
    }

    fn verify_full(self) -> Self {
        self.ssl_mode(PgSslMode::VerifyFull)
    }
}

#[cfg(test)]
mod tests {
    use super::TLS;
    use crate::tls::Target;
    use justonce_core::Error;

    #[test]
    fn a_remote_postgres_server_is_verified_unless_the_url_says_otherwise() {
        use sqlx::postgres::{PgConnectOptions, PgSslMode};
        let mode = |url: &str| {
            Target::<PgConnectOptions>::parse(url, &TLS)
                .unwrap()
                .options
                .get_ssl_mode()
        };
        assert!(matches!(
            mode("postgres://app@db.example.com/app"),
            PgSslMode::VerifyFull
        ));
        assert!(matches!(
            mode("postgres://app@127.0.0.1/app"),
            PgSslMode::Prefer
        ));
        assert!(matches!(
            mode("postgres://app@localhost/app"),
            PgSslMode::Prefer
        ));
        assert!(matches!(
            mode("postgres://app@db.example.com/app?sslmode=require"),
            PgSslMode::Require
        ));
        assert!(matches!(
            mode("postgres://app@127.0.0.1/app?sslmode=verify-full"),
            PgSslMode::VerifyFull
        ));
    }

    #[test]
    fn unusable_tls_settings_name_the_setting_and_not_the_password() {
        use sqlx::postgres::PgConnectOptions;
        let error = |url: &str| match Target::<PgConnectOptions>::parse(url, &TLS) {
            Err(Error::Config(message)) => message,
            Err(other) => panic!("{url}: {other}"),
            Ok(_) => panic!("{url} was accepted"),
        };
        let missing =
            error("postgres://app:hunter2@db.example.com/app?sslrootcert=/no/such/ca.pem");
        assert!(
            missing.starts_with("database postgres://app@db.example.com/app?sslrootcert="),
            "{missing}"
        );
        assert!(
            missing.contains("sslrootcert: cannot read /no/such/ca.pem"),
            "{missing}"
        );
        assert!(!missing.contains("hunter2"), "{missing}");
        let mode = error("postgres://app@db.example.com/app?sslmode=verify-everything");
        assert!(
            mode.contains("sslmode=verify-everything is not a mode"),
            "{mode}"
        );
    }
}
