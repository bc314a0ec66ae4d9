//! MariaDB's and MySQL's names for their TLS settings, and what their servers say when
//! they want TLS.

use crate::tls::{Dialect, Protection, TlsOptions};
use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};

/// MySQL's names for its TLS settings, as sqlx reads them.
pub(super) static TLS: Dialect = Dialect {
    name: "MariaDB/MySQL",
    mode: &["ssl-mode", "sslmode"],
    verify_full: "VERIFY_IDENTITY",
    disable: "DISABLED",
    ca: &["ssl-ca", "sslca"],
    client: [&["ssl-cert", "sslcert"], &["ssl-key", "sslkey"]],
    protection: |mode| match mode {
        "disabled" => Some(Protection::Plain),
        "preferred" => Some(Protection::Opportunistic),
        "required" => Some(Protection::Unverified),
        "verify_ca" => Some(Protection::CaOnly),
        "verify_identity" => Some(Protection::Full),
        _ => None,
    },
    // require_secure_transport=ON: MySQL's 3159 says "insecure transport"; MariaDB 10.11
    // answers a plain-text connection with 1045 "Access denied", as for a bad password.
    refused_plain_text: |error| {
        error.message().contains("insecure transport")
            || error.message().starts_with("Access denied")
    },
    // A user created `REQUIRE X509` is denied access like any other without a certificate.
    wants_client_certificate: |_| false,
};

impl TlsOptions for MySqlConnectOptions {
    const MODE_VARIABLE: Option<&'static str> = None;

    fn host(&self) -> &str {
        self.get_host()
    }

    fn is_socket(&self) -> bool {
        self.get_socket().is_some()
    }

    fn verify_full(self) -> Self {
        self.ssl_mode(MySqlSslMode::VerifyIdentity)
    }
}

#[cfg(test)]
mod tests {
    use super::TLS;
    use crate::tls::Target;

    #[test]
    fn a_remote_mysql_server_is_verified_unless_the_url_says_otherwise() {
        use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};
        let mode = |url: &str| {
            Target::<MySqlConnectOptions>::parse(url, &TLS)
                .unwrap()
                .options
                .get_ssl_mode()
        };
        assert!(matches!(
            mode("mysql://app@db.example.com/app"),
            MySqlSslMode::VerifyIdentity
        ));
        assert!(matches!(
            mode("mysql://app@127.0.0.1/app"),
            MySqlSslMode::Preferred
        ));
        assert!(matches!(
            mode("mysql://app@db.example.com/app?ssl-mode=REQUIRED"),
            MySqlSslMode::Required
        ));
    }
}
