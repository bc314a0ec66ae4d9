//! `justonce.toml` and the `JUSTONCE_*` variables that override it or stand in for it,
//! turned into validated settings before anything starts.
//!
//! Two steps, raw then validated: [`read`] turns the file and the variables into a raw
//! document that knows where each value came from, and [`validate`] checks it into the
//! [`Settings`] the rest of the binary uses.

mod read;
mod settings;
#[cfg(test)]
mod testing;
mod validate;

pub use read::{Env, process_env, redacted};
pub use settings::{BrokerOptions, ConsumerSettings, Limits, LogFormat, Role, Roles, Settings};

use anyhow::{Context, Result, bail};
use read::Reading;
use std::path::Path;

/// Reads `path`, applies the `JUSTONCE_*` variables and `DATABASE_URL` from `env`, and
/// validates. The file may be absent (every value has a default or comes from the
/// environment) unless the user named it, `named_by` an option.
/// Every error names the file, the setting's dotted key with its line (or the variable that
/// set it), and what was expected.
pub fn load(path: &Path, named_by: Option<&str>, env: &Env) -> Result<Settings> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, &file, env),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => match named_by {
            Some(option) => bail!("{file} (from {option}): no such file"),
            None => settings_of(None, &file, env),
        },
        Err(error) => Err(error).with_context(|| format!("reading {file}")),
    }
}

/// [`load`] for the text of the file named `file`; the fuzz target calls it without a file.
pub fn parse(text: &str, file: &str, env: &Env) -> Result<Settings> {
    settings_of(Some(text), file, env)
}

/// [`load`] for the text of `file`, `None` when there is no such file.
fn settings_of(text: Option<&str>, file: &str, env: &Env) -> Result<Settings> {
    let Reading {
        raw,
        origin,
        unknown_variables,
    } = read::read(text, file, env)?;
    let mut settings =
        validate::validate(raw, env, &origin).with_context(|| origin.named_file())?;
    settings.unknown_variables = unknown_variables;
    settings.printed = origin.print();
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::testing::{SHOP, assert_named, env_of, load_text, shop_and_orders};
    use std::time::Duration;

    #[test]
    fn a_file_with_defaults_and_overrides() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_LISTEN", "127.0.0.1:18080"),
            ("JUSTONCE_SOURCES_SHOP_RETENTION", "10d"),
            ("JUSTONCE_SERVER_RELAY_LEASE", "5s"),
        ]);
        let settings = load_text(SHOP, &env).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:18080".parse().unwrap());
        assert_eq!(settings.admin_listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(settings.database, "sqlite://justonce.db");
        assert_eq!(settings.body_limit, 64 * 1024);
        assert_eq!(settings.relay_lease, Duration::from_secs(5));
        assert_eq!(settings.purge_every, Some(Duration::from_secs(3_600)));
        let shop = &settings.sources[0];
        assert_eq!(shop.source.name(), "shop");
        assert_eq!(shop.retention.keep(), Duration::from_secs(10 * 86_400));
        assert_eq!(shop.deliver_for, Duration::from_secs(3 * 86_400));
    }

    /// The example users start from is a configuration the service takes, with the
    /// settings it says.
    #[test]
    fn the_example_configuration_loads() {
        let env = env_of(&[
            ("DEMO_WEBHOOK_SECRET", "the demo signing secret"),
            ("SHOP_WEBHOOK_SECRET", "whsec_c2VjcmV0"),
        ]);
        let example = include_str!("../../../../examples/justonce.toml");
        let settings = load_text(example, &env).unwrap();
        let sources: Vec<&str> = settings.sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(sources, ["demo", "shop"]);
        assert_eq!(settings.relay_lease, Duration::from_secs(60));
        assert_eq!(settings.purge_every, Some(Duration::from_secs(3_600)));
    }

    #[test]
    fn every_mistake_names_the_file_the_key_and_what_was_expected() {
        // Long enough as a raw secret too, for the cases that change the scheme.
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
        ]);
        let both = shop_and_orders();
        assert!(load_text(&both, &env).is_ok());
        let edit = |from: &str, to: &str| {
            assert!(both.contains(from), "{from:?}");
            both.replacen(from, to, 1)
        };
        let unknown = "unknown field";
        let cases = [
            // Unknown keys, at every level.
            (edit("[server]", "[serverr]"), "serverr (line 2)", unknown),
            (
                edit("listen =", "lisen ="),
                "server.lisen (line 3)",
                unknown,
            ),
            (
                edit("secrets =", "secret ="),
                "sources.shop.secret (line 8)",
                unknown,
            ),
            (
                edit("max_attempts", "max_attemps"),
                "consumers.orders.max_attemps (line 15)",
                unknown,
            ),
            // Wrong types.
            (
                edit("\"127.0.0.1:8080\"", "8080"),
                "server.listen (line 3)",
                "expected a string",
            ),
            (
                edit("[\"env:SHOP_SECRET\"]", "\"env:SHOP_SECRET\""),
                "sources.shop.secrets (line 8)",
                "expected a sequence",
            ),
            (
                edit("max_attempts = 3", "max_attempts = \"three\""),
                "consumers.orders.max_attempts (line 15)",
                "is not a whole number",
            ),
            (
                edit("max_attempts = 3", "max_attempts = -1"),
                "consumers.orders.max_attempts (line 15)",
                "must not be negative",
            ),
            (
                edit("max_attempts = 3", "max_attempts = 1.5"),
                "consumers.orders.max_attempts (line 15)",
                "expected a whole number",
            ),
            (
                format!("{both}prefetch = 70000\n"),
                "consumers.orders.prefetch (line 17)",
                "must be at most 65535",
            ),
            (
                "sources = 3\n".to_owned(),
                "sources (line 1)",
                "expected a map",
            ),
            (
                "[sources]\nshop = \"x\"\n".to_owned(),
                "sources.shop (line 2)",
                "expected a table of source settings",
            ),
            // Missing required keys.
            (
                edit("target = \"http://127.0.0.1:9000/hooks/shop\"\n", ""),
                "sources.shop.target",
                "is required",
            ),
            (
                edit("scheme = \"standard-webhooks\"\n", ""),
                "sources.shop.scheme",
                "is required",
            ),
            (
                edit("from = \"env:ORDERS_BROKER\"\n", ""),
                "consumers.orders.from",
                "is required",
            ),
            (
                edit("queue = \"orders\"\n", ""),
                "consumers.orders.queue",
                "must name a queue",
            ),
            (
                edit("standard-webhooks", "hmac-sha256"),
                "sources.shop.id",
                "is required for scheme hmac-sha256",
            ),
            // Bad durations and sizes.
            (
                format!("{both}retention = \"7 days\"\n"),
                "consumers.orders.retention (line 17)",
                "unknown unit: use ms, s, m, h or d",
            ),
            (
                edit(
                    "target = \"http://127.0.0.1:9000/hooks/shop\"",
                    "target = \"http://127.0.0.1:9000/hooks/shop\"\nretry_horizon = \"3x\"",
                ),
                "sources.shop.retry_horizon (line 10)",
                "unknown unit",
            ),
            (
                edit("\"64KiB\"", "\"-1\""),
                "server.body_limit (line 4)",
                "not a size such as 1MiB",
            ),
            (
                edit("\"64KiB\"", "\"1 TB\""),
                "server.body_limit (line 4)",
                "use B, KiB",
            ),
            (
                edit("\"64KiB\"", "\"0\""),
                "server.body_limit (line 4)",
                "more than zero",
            ),
            (
                edit("body_limit = \"64KiB\"", "purge_every = \"0s\""),
                "server.purge_every (line 4)",
                "more than zero, or \"off\"",
            ),
            (
                edit("body_limit = \"64KiB\"", "purge_every = \"never\""),
                "server.purge_every (line 4)",
                "not a duration",
            ),
            (
                edit("body_limit = \"64KiB\"", "relay_lease = \"1500ms\""),
                "server.relay_lease (line 4)",
                "at least 2s",
            ),
            (
                format!("{both}retention = \"1h\"\n"),
                "consumers.orders.retention (line 17)",
                "shorter than the sender's retry horizon",
            ),
            // Bad URLs, addresses and names.
            (
                "[server]\ndatabase = \"mongodb://u:hunter2@x\"\n".to_owned(),
                "server.database (line 2)",
                "sqlite://, postgres:// or mysql://",
            ),
            (
                "[server]\ndatabase = \"postgres://u:hunter2@h1,h2/app?target_session_attrs=standby\"\n"
                    .to_owned(),
                "server.database (line 2)",
                "target_session_attrs=standby chooses a server that refuses writes",
            ),
            (
                edit("http://127.0.0.1:9000/hooks/shop", "not a url"),
                "sources.shop.target (line 9)",
                "http:// or https://",
            ),
            (
                edit("http://127.0.0.1:9000/orders", "ftp://127.0.0.1/orders"),
                "consumers.orders.target (line 16)",
                "http or https",
            ),
            (
                edit("env:ORDERS_BROKER", "pulsar://127.0.0.1:6650"),
                "consumers.orders.from (line 12)",
                "amqp://, nats://, redis://, mqtt:// or kafka://",
            ),
            (
                edit("127.0.0.1:8080", "localhost"),
                "server.listen (line 3)",
                "an address such as",
            ),
            (
                edit("standard-webhooks", "magic"),
                "sources.shop.scheme (line 7)",
                "not one of",
            ),
            (
                edit("env:SHOP_SECRET", "whsec_inline"),
                "sources.shop.secrets (line 8)",
                "env:VARIABLE",
            ),
            (
                format!("{both}target_secret = \"inline\"\n"),
                "consumers.orders.target_secret (line 17)",
                "env:VARIABLE",
            ),
            (
                edit("SHOP_SECRET", "MISSING_SECRET"),
                "sources.shop.secrets (line 8)",
                "MISSING_SECRET is not set",
            ),
            (
                format!("{SHOP}tolerance = \"5\"\n"),
                "sources.shop.tolerance (line 10)",
                "needs a unit",
            ),
            (
                format!("{SHOP}tolerance = \"0s\"\n"),
                "sources.shop.tolerance (line 10)",
                "more than zero",
            ),
            (
                SHOP.replace("standard-webhooks", "github") + "tolerance = \"1m\"\n",
                "sources.shop.tolerance (line 10)",
                "only applies to standard-webhooks and stripe",
            ),
            (
                format!("{SHOP}signature_header = \"X-Sig\"\n"),
                "sources.shop.signature_header (line 10)",
                "only applies to hmac-sha256",
            ),
            (
                edit("header:X-Order-Id", "body"),
                "consumers.orders.id (line 14)",
                "\"message_id\", \"header:NAME\" or \"json:/POINTER\"",
            ),
            (
                edit("[sources.shop]", "[sources.\"a:b\"]"),
                "sources.a:b (line 6)",
                "may not contain",
            ),
            (
                edit("[consumers.orders]", "[consumers.shop]"),
                "consumers.shop (line 11)",
                "both a source and a consumer",
            ),
        ];
        for (text, key, expected) in cases {
            assert_named(&text, &env, key, expected);
        }
    }

    #[test]
    fn syntax_errors_name_the_file_and_the_line() {
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        for (text, line) in [
            ("[server\nlisten = \"x\"\n", "line 1"),
            ("[server]\nlisten = \n", "line 2"),
            ("[server]\n\nlisten = \"a\"\nlisten = \"b\"\n", "line 4"),
            ("[server]\nlisten = \"unterminated\n", "line 2"),
            ("[server]\nlisten = \"a\" trailing\n", "line 2"),
        ] {
            assert_named(text, &env, "is not valid TOML", line);
        }
    }
}
