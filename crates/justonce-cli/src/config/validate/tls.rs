//! A consumer's TLS settings: its CA, its client certificate and how the broker's
//! certificate is checked.

use super::secret::resolve_secret;
use crate::config::read::{Env, RawConsumer};
use anyhow::{Context, Result, bail};
use justonce_transport::tls::Tls;

/// A consumer's TLS settings, with its files read and checked; `None` when it has none.
/// `takes_tls`: whether the URL connects over TLS (`amqps://`, `rediss://`, `mqtts://`) or
/// may (NATS, where the settings require TLS of the server).
pub fn consumer_tls(
    raw: &RawConsumer,
    takes_tls: bool,
    env: &Env,
    at: &dyn Fn(&'static str) -> String,
) -> Result<Option<Tls>> {
    let settings = [
        ("tls_ca", &raw.tls_ca),
        ("tls_cert", &raw.tls_cert),
        ("tls_key", &raw.tls_key),
        ("tls_verify", &raw.tls_verify),
    ];
    let Some((first, _)) = settings.iter().find(|(_, value)| value.is_some()) else {
        return Ok(None);
    };
    if !takes_tls {
        bail!(
            "{}: needs a TLS URL: amqps://, rediss://, mqtts:// (or nats://)",
            at(first)
        );
    }
    let read = |key: &'static str, path: &str| {
        std::fs::read(path).with_context(|| format!("{}: cannot read {path}", at(key)))
    };
    let mut tls = Tls::default();
    if let Some(path) = &raw.tls_ca {
        tls = tls
            .with_ca(read("tls_ca", path)?)
            .with_context(|| at("tls_ca"))?;
    }
    match (&raw.tls_cert, &raw.tls_key) {
        (Some(cert), Some(key)) => {
            let key = match key.strip_prefix("env:") {
                Some(_) => resolve_secret(key, env)
                    .with_context(|| at("tls_key"))?
                    .into_bytes(),
                None => read("tls_key", key)?,
            };
            tls = tls
                .with_client(read("tls_cert", cert)?, key)
                .with_context(|| format!("{} and tls_key", at("tls_cert")))?;
        }
        (Some(_), None) => bail!(
            "{}: needs tls_key, the client certificate's key",
            at("tls_cert")
        ),
        (None, Some(_)) => bail!("{}: needs tls_cert, the key's certificate", at("tls_key")),
        (None, None) => {}
    }
    match raw.tls_verify.as_deref().unwrap_or("full") {
        "full" => {}
        "insecure" if raw.tls_ca.is_some() => bail!(
            "{}: \"insecure\" checks no certificate: tls_ca would not be used",
            at("tls_verify")
        ),
        "insecure" => tls = tls.insecure(),
        other => bail!(
            "{}: {other:?} must be \"full\" (the default: the broker's certificate is signed \
             by a trusted CA and names the host) or \"insecure\" (nothing is checked)",
            at("tls_verify")
        ),
    }
    Ok(Some(tls))
}

/// `options` with the TLS settings, if any.
pub fn with_tls<O>(options: O, tls: &Option<Tls>, set: fn(O, Tls) -> O) -> O {
    match tls {
        Some(tls) => set(options, tls.clone()),
        None => options,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{ORDERS, SHOP, env_of, error_of, load_text};

    #[test]
    fn a_consumers_tls_settings_are_read_and_checked() {
        let ca = justonce_tests::tls::TestCa::new();
        let (cert, key) = ca.client("justonce");
        let (_, other_key) = ca.client("someone-else");
        let key_pem = std::fs::read_to_string(&key).unwrap();
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqps://guest:hunter2@127.0.0.1:5671/%2f"),
            ("ORDERS_CLIENT_KEY", &key_pem),
        ]);
        let with = |settings: &str| format!("{SHOP}{ORDERS}{settings}\n");
        let ca_file = ca.ca_file().display().to_string();
        let tls = format!(
            "tls_ca = \"{ca_file}\"\ntls_cert = \"{}\"\ntls_key = \"env:ORDERS_CLIENT_KEY\"",
            cert.display()
        );
        let settings = load_text(&with(&tls), &env).unwrap();
        let [orders] = settings.consumers.as_slice() else {
            panic!("one consumer");
        };
        assert!(!orders.tls_insecure);
        let options = format!("{:?}", orders.options);
        assert!(options.contains("client_certificate: true"), "{options}");
        assert!(
            !options.contains("PRIVATE KEY"),
            "the key was printed: {options}"
        );
        let insecure = load_text(&with("tls_verify = \"insecure\""), &env).unwrap();
        assert!(insecure.consumers[0].tls_insecure);
        let from_variable = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqps://guest:hunter2@127.0.0.1:5671/%2f"),
            ("JUSTONCE_CONSUMERS_ORDERS_TLS_CA", "/nowhere/ca.pem"),
        ]);
        assert!(error_of(&with(""), &from_variable).contains(
            "consumers.orders.tls_ca (from JUSTONCE_CONSUMERS_ORDERS_TLS_CA): cannot read \
                 /nowhere/ca.pem"
        ));
        let cases = [
            (
                "tls_ca = \"/nowhere/ca.pem\"".to_owned(),
                "consumers.orders.tls_ca (line 17): cannot read /nowhere/ca.pem".to_owned(),
            ),
            (
                format!("tls_ca = \"{}\"", key.display()),
                "consumers.orders.tls_ca (line 17): invalid configuration: the CA file holds no \
                 PEM certificate"
                    .to_owned(),
            ),
            (
                format!("tls_cert = \"{}\"", cert.display()),
                "consumers.orders.tls_cert (line 17): needs tls_key".to_owned(),
            ),
            (
                "tls_key = \"env:ORDERS_CLIENT_KEY\"".to_owned(),
                "consumers.orders.tls_key (line 17): needs tls_cert".to_owned(),
            ),
            (
                format!(
                    "tls_cert = \"{}\"\ntls_key = \"{}\"",
                    cert.display(),
                    other_key.display()
                ),
                "the client key does not belong to the client certificate".to_owned(),
            ),
            (
                format!(
                    "tls_cert = \"{}\"\ntls_key = \"env:NO_KEY\"",
                    cert.display()
                ),
                "consumers.orders.tls_key (line 18): the environment variable NO_KEY is not set"
                    .to_owned(),
            ),
            (
                "tls_verify = \"none\"".to_owned(),
                "consumers.orders.tls_verify (line 17): \"none\" must be \"full\"".to_owned(),
            ),
            (
                format!("tls_ca = \"{ca_file}\"\ntls_verify = \"insecure\""),
                "tls_ca would not be used".to_owned(),
            ),
        ];
        for (settings, expected) in cases {
            let error = error_of(&with(&settings), &env);
            assert!(error.contains(&expected), "{expected:?} not in {error:?}");
            assert!(
                !error.contains("hunter2"),
                "a password was printed: {error}"
            );
        }
        let plain = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
        ]);
        let error = error_of(&with(&format!("tls_ca = \"{ca_file}\"")), &plain);
        assert!(
            error.contains("consumers.orders.tls_ca (line 17): needs a TLS URL: amqps://"),
            "{error}"
        );
        let redis = ORDERS.replace("env:ORDERS_BROKER", "redis://127.0.0.1:6379");
        let redis = redis.replace("queue = \"orders\"", "stream = \"orders\"");
        let error = error_of(&format!("{SHOP}{redis}tls_verify = \"full\"\n"), &plain);
        assert!(
            error.contains("consumers.orders.tls_verify (line 17): needs a TLS URL"),
            "{error}"
        );
    }
}
