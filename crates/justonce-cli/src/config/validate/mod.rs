//! Validating: the raw document into [`Settings`], every value checked and every default
//! filled in, each error naming its setting by where it came from.

mod consumer;
mod entry;
mod secret;
mod source;
mod tls;
mod traces;
mod units;

use super::read::{Count, Env, Origin, RawConfig, quoted};
use super::settings::{Limits, LogFormat, Roles, Settings};
use crate::admin_api::AdminToken;
use anyhow::{Context, Result, anyhow, bail};
use justonce_cli_support::database::DatabaseKind;
use justonce_cli_support::parse_duration;
use justonce_sql::RelayOptions;
use std::net::SocketAddr;
use std::time::Duration;
use units::{duration_text, parse_size};

/// The shortest `server.relay_lease`.
const MIN_RELAY_LEASE: Duration = Duration::from_secs(2);

/// The server's settings, then each source and consumer.
pub fn validate(raw: RawConfig, env: &Env, origin: &Origin<'_>) -> Result<Settings> {
    let server = raw.server;
    let address = |value: Option<String>, default: &str, key: &str| -> Result<SocketAddr> {
        let value = origin.or_default(&["server", key], value.as_deref(), default);
        value.parse().map_err(|_| {
            anyhow!(
                "{}: {value:?} is not an address such as 127.0.0.1:8080",
                origin.name(&["server", key])
            )
        })
    };
    let database = origin
        .or_default(
            &["server", "database"],
            server.database.as_deref(),
            "sqlite://justonce.db",
        )
        .to_owned();
    match DatabaseKind::of(&database) {
        // The URL itself may hold a password: it is not repeated.
        Err(unknown) => bail!("{}: {unknown}", origin.name(&["server", "database"])),
        Ok(DatabaseKind::Postgres) => justonce_sql::check_postgres_hosts(&database)
            .map_err(|problem| anyhow!("{}: {problem}", origin.name(&["server", "database"])))?,
        Ok(_) => {}
    }
    let body_limit = parse_size(origin.or_default(
        &["server", "body_limit"],
        server.body_limit.as_deref(),
        "1MiB",
    ))
    .with_context(|| origin.name(&["server", "body_limit"]))?;
    if body_limit == 0 {
        bail!(
            "{}: must be more than zero bytes",
            origin.name(&["server", "body_limit"])
        );
    }
    let relay_lease = parse_duration(origin.or_default(
        &["server", "relay_lease"],
        server.relay_lease.as_deref(),
        "60s",
    ))
    .with_context(|| origin.name(&["server", "relay_lease"]))?;
    if relay_lease < MIN_RELAY_LEASE {
        bail!(
            "{}: must be at least 2s, to give a delivery time within it",
            origin.name(&["server", "relay_lease"])
        );
    }
    let purge_every = match origin.or_default(
        &["server", "purge_every"],
        server.purge_every.as_deref(),
        "1h",
    ) {
        "off" => None,
        every => {
            let every =
                parse_duration(every).with_context(|| origin.name(&["server", "purge_every"]))?;
            if every.is_zero() {
                bail!(
                    "{}: must be more than zero, or \"off\"",
                    origin.name(&["server", "purge_every"])
                );
            }
            Some(every)
        }
    };
    let roles = origin
        .or_default(&["server", "roles"], server.roles.as_deref(), "all")
        .parse::<Roles>()
        .map_err(anyhow::Error::msg)
        .with_context(|| origin.name(&["server", "roles"]))?;
    let positive = |value: Option<&str>, default: Duration, key: &str| -> Result<Duration> {
        let Some(value) = value else {
            origin.defaulted(&["server", key], quoted(&duration_text(default)));
            return Ok(default);
        };
        let duration = parse_duration(value).with_context(|| origin.name(&["server", key]))?;
        if duration.is_zero() {
            bail!("{}: must be more than zero", origin.name(&["server", key]));
        }
        Ok(duration)
    };
    let count = |value: Option<Count>, default: usize, range: (u64, u64), key: &str| {
        let value = value.map_or_else(
            || {
                origin.defaulted(&["server", key], default.to_string());
                default as u64
            },
            |count| count.0,
        );
        if value < range.0 || value > range.1 {
            bail!(
                "{}: must be from {} to {}",
                origin.name(&["server", key]),
                range.0,
                range.1
            );
        }
        Ok(value)
    };
    let default = Limits::default();
    let limits = Limits {
        header_timeout: positive(
            server.header_timeout.as_deref(),
            default.header_timeout,
            "header_timeout",
        )?,
        request_timeout: positive(
            server.request_timeout.as_deref(),
            default.request_timeout,
            "request_timeout",
        )?,
        max_connections: count(
            server.max_connections,
            default.max_connections,
            (1, 1_000_000),
            "max_connections",
        )? as usize,
        max_requests: count(
            server.max_requests,
            default.max_requests,
            (1, 1_000_000),
            "max_requests",
        )? as usize,
    };
    let pool_size = count(server.pool_size, 10, (1, 10_000), "pool_size")? as u32;
    // Unless set, each cap follows the other instead of refusing it: the total rises to a
    // larger cap per tenant, and the cap per tenant falls to a smaller total.
    let relay_total_set = server.relay_per_destination_total.is_some();
    let relay_per_destination_total = count(
        server.relay_per_destination_total,
        RelayOptions::DEFAULT_PER_DESTINATION_TOTAL,
        (1, 10_000),
        "relay_per_destination_total",
    )? as usize;
    let relay_per_destination = count(
        server.relay_per_destination,
        if relay_total_set {
            RelayOptions::DEFAULT_PER_DESTINATION.min(relay_per_destination_total)
        } else {
            RelayOptions::DEFAULT_PER_DESTINATION
        },
        (1, 10_000),
        "relay_per_destination",
    )? as usize;
    let relay_per_destination_total = if relay_total_set {
        relay_per_destination_total
    } else {
        relay_per_destination_total.max(relay_per_destination)
    };
    if relay_per_destination_total < relay_per_destination {
        bail!(
            "{}: must be at least server.relay_per_destination ({relay_per_destination}): \
             one tenant may have that many in flight",
            origin.name(&["server", "relay_per_destination_total"])
        );
    }
    let acquire_timeout = positive(
        server.acquire_timeout.as_deref(),
        Duration::from_secs(2),
        "acquire_timeout",
    )?;
    let share_commits = server.share_commits.map_or_else(
        || {
            origin.defaulted(&["server", "share_commits"], "true".to_owned());
            true
        },
        |switch| switch.0,
    );
    let log_format = match server.log_format.as_deref() {
        None => LogFormat::default(),
        Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => bail!(
            "{}: {other:?} is not \"text\" or \"json\"",
            origin.name(&["server", "log_format"])
        ),
    };
    let traces_url = traces::traces_url(server.otlp_endpoint.as_deref(), env, origin)?;
    let admin_token = server
        .admin_token
        .map(|reference| {
            secret::resolve_secret(&reference, env)
                .map(|token| AdminToken::new(&token))
                .with_context(|| origin.name(&["server", "admin_token"]))
        })
        .transpose()?;
    // A delivery still running when its lease ends may be sent again by another relay,
    // with the same key: none starts after half the lease, and each gives up within the
    // other half, so that the two rarely overlap.
    let longest_timeout = relay_lease / 2;
    let sources = raw
        .sources
        .into_iter()
        .map(|(name, source)| source::validate_source(&name, source, longest_timeout, env, origin))
        .collect::<Result<Vec<_>>>()?;
    let consumers = raw
        .consumers
        .into_iter()
        .map(|(name, consumer)| {
            consumer::validate_consumer(&name, consumer, longest_timeout, env, origin)
        })
        .collect::<Result<Vec<_>>>()?;
    // Sources and consumers share the store's consumer names and the relay's destinations.
    if let Some(both) = consumers
        .iter()
        .find(|c| sources.iter().any(|s| s.name == c.name))
    {
        bail!(
            "{}: {:?} names both a source and a consumer: they share one namespace",
            origin.name(&["consumers", &both.name]),
            both.name
        );
    }
    Ok(Settings {
        listen: address(server.listen, "127.0.0.1:8080", "listen")?,
        admin_listen: address(server.admin_listen, "127.0.0.1:9090", "admin_listen")?,
        database,
        body_limit,
        relay_lease,
        relay_per_destination,
        relay_per_destination_total,
        purge_every,
        roles,
        limits,
        pool_size,
        acquire_timeout,
        share_commits,
        sources,
        consumers,
        log_format,
        traces_url,
        admin_token,
        unknown_variables: Vec::new(),
        printed: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{SHOP, assert_named, env_of, load_text};
    use std::time::Duration;

    #[test]
    fn the_service_purge_can_be_turned_off() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_PURGE_EVERY", "off"),
        ]);
        assert_eq!(load_text(SHOP, &env).unwrap().purge_every, None);
        let every = SHOP.replace("body_limit", "purge_every = \"10m\"\nbody_limit");
        let settings = load_text(&every, &env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")])).unwrap();
        assert_eq!(settings.purge_every, Some(Duration::from_secs(600)));
    }

    /// Values that would let an event act twice, or that no clock can schedule, are refused
    /// at start with the setting named.
    #[test]
    fn unsafe_values_are_refused_naming_the_setting() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("DEMO_SECRET", "hunter2"),
        ]);
        let demo = "\n[sources.demo]\nscheme = \"hmac-sha256\"\nsecrets = [\"env:DEMO_SECRET\"]\n\
                    id = \"json:/id\"\ntarget = \"http://127.0.0.1:9000/demo\"\n";
        let edit = |from: &str, to: &str| {
            assert!(SHOP.contains(from), "{from:?}");
            SHOP.replacen(from, to, 1)
        };
        let cases = [
            (
                format!("{SHOP}{demo}"),
                "sources.demo.secrets",
                "shorter than 16 bytes",
            ),
            (
                edit(
                    "scheme = \"standard-webhooks\"",
                    "scheme = \"standard-webhooks\"\ntolerance = \"10m\"\nretry_horizon = \"1m\"\nretention = \"5m\"",
                ),
                "sources.shop.tolerance (line 8)",
                "must be shorter than retention (5m)",
            ),
            (
                edit("body_limit", "purge_every = \"1000000000d\"\nbody_limit"),
                "server.purge_every (line 4)",
                "too long: at most 36500d",
            ),
            (
                edit("target =", "timeout = \"31s\"\ntarget ="),
                "sources.shop.timeout (line 9)",
                "at most half of server.relay_lease",
            ),
            (
                edit("body_limit", "max_connections = 0\nbody_limit"),
                "server.max_connections (line 4)",
                "must be from 1 to 1000000",
            ),
            (
                edit("body_limit", "header_timeout = \"0s\"\nbody_limit"),
                "server.header_timeout (line 4)",
                "must be more than zero",
            ),
        ];
        for (text, key, expected) in cases {
            assert_named(&text, &env, key, expected);
        }
    }

    /// The relay's caps per destination come from the file or a variable, and the relay's
    /// deliveries in flight follow a larger total; a cap left unset follows the other; a
    /// cap of zero, or a total below the cap per tenant, is refused with the setting named.
    #[test]
    fn the_relay_caps_per_destination_are_read_and_checked() {
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        let defaults = load_text(SHOP, &env).unwrap();
        assert_eq!(defaults.relay_per_destination, 8);
        assert_eq!(defaults.relay_per_destination_total, 16);
        assert_eq!(defaults.relay_concurrency(), 16);
        let both = SHOP.replace(
            "body_limit",
            "relay_per_destination = 2\nrelay_per_destination_total = 40\nbody_limit",
        );
        let settings = load_text(&both, &env).unwrap();
        assert_eq!(settings.relay_per_destination, 2);
        assert_eq!(settings.relay_per_destination_total, 40);
        // A destination may take more than the relay's usual 16 in flight only if the
        // relay keeps that many.
        assert_eq!(settings.relay_concurrency(), 40);
        // A larger cap per tenant raises the total it was not given, instead of failing.
        let lane = SHOP.replace("body_limit", "relay_per_destination = 20\nbody_limit");
        let settings = load_text(&lane, &env).unwrap();
        assert_eq!(settings.relay_per_destination_total, 20);
        // A smaller total lowers the cap per tenant it was not given, instead of failing.
        let one = SHOP.replace("body_limit", "relay_per_destination_total = 1\nbody_limit");
        let settings = load_text(&one, &env).unwrap();
        assert_eq!(
            (
                settings.relay_per_destination,
                settings.relay_per_destination_total
            ),
            (1, 1)
        );
        let twelve = SHOP.replace("body_limit", "relay_per_destination_total = 12\nbody_limit");
        let settings = load_text(&twelve, &env).unwrap();
        assert_eq!(
            (
                settings.relay_per_destination,
                settings.relay_per_destination_total
            ),
            (8, 12)
        );
        let by_variable = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_RELAY_PER_DESTINATION", "1"),
        ]);
        assert_eq!(
            load_text(SHOP, &by_variable).unwrap().relay_per_destination,
            1
        );

        let below = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_RELAY_PER_DESTINATION", "8"),
            ("JUSTONCE_SERVER_RELAY_PER_DESTINATION_TOTAL", "4"),
        ]);
        assert_named(
            SHOP,
            &below,
            "server.relay_per_destination_total (from JUSTONCE_SERVER_RELAY_PER_DESTINATION_TOTAL)",
            "must be at least server.relay_per_destination (8)",
        );
        for (setting, value) in [
            ("relay_per_destination", "0"),
            ("relay_per_destination_total", "0"),
            ("relay_per_destination", "10001"),
        ] {
            let text = SHOP.replace("body_limit", &format!("{setting} = {value}\nbody_limit"));
            assert_named(
                &text,
                &env,
                &format!("server.{setting} (line 4)"),
                "must be from 1 to 10000",
            );
        }
        let text = SHOP.replace(
            "body_limit",
            "relay_per_destination = \"eight\"\nbody_limit",
        );
        assert_named(
            &text,
            &env,
            "server.relay_per_destination (line 4)",
            "is not a whole number",
        );
    }

    /// The admin token is a reference to a variable that must be set when the service
    /// starts, never the token itself.
    #[test]
    fn the_admin_token_is_read_from_its_variable() {
        let text = SHOP.replace(
            "body_limit",
            "admin_token = \"env:ADMIN_TOKEN\"\nbody_limit",
        );
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ADMIN_TOKEN", "a long random token"),
        ]);
        assert!(load_text(&text, &env).unwrap().admin_token.is_some());
        assert!(load_text(SHOP, &env).unwrap().admin_token.is_none());
        let without = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        let key = "server.admin_token (line 4)";
        assert_named(
            &text,
            &without,
            key,
            "the environment variable ADMIN_TOKEN is not set",
        );
        let inline = SHOP.replace("body_limit", "admin_token = \"hunter2\"\nbody_limit");
        assert_named(&inline, &env, key, "secrets are written env:VARIABLE");
    }

    #[test]
    fn listener_limits_and_the_pool_come_from_the_file_or_variables() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_MAX_CONNECTIONS", "300"),
            ("JUSTONCE_SERVER_ACQUIRE_TIMEOUT", "500ms"),
            ("JUSTONCE_SOURCES_SHOP_TIMEOUT", "3s"),
        ]);
        let text = SHOP.replace("body_limit", "max_requests = 20\nbody_limit");
        let settings = load_text(&text, &env).unwrap();
        assert_eq!(settings.limits.max_connections, 300);
        assert_eq!(settings.limits.max_requests, 20);
        assert_eq!(settings.limits.header_timeout, Duration::from_secs(10));
        assert_eq!(settings.acquire_timeout, Duration::from_millis(500));
        assert_eq!(settings.pool_size, 10);
        let bad = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_POOL_SIZE", "ten"),
        ]);
        assert_named(
            SHOP,
            &bad,
            "server.pool_size (from JUSTONCE_SERVER_POOL_SIZE)",
            "is not a whole number",
        );
    }

    #[test]
    fn commits_are_shared_unless_the_file_or_a_variable_says_false() {
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        assert!(load_text(SHOP, &env).unwrap().share_commits);
        let off = SHOP.replace("body_limit", "share_commits = false\nbody_limit");
        assert!(!load_text(&off, &env).unwrap().share_commits);
        let by_variable = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_SHARE_COMMITS", "false"),
        ]);
        assert!(!load_text(SHOP, &by_variable).unwrap().share_commits);
        let bad = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_SHARE_COMMITS", "yes"),
        ]);
        assert_named(
            SHOP,
            &bad,
            "server.share_commits (from JUSTONCE_SERVER_SHARE_COMMITS)",
            "is not true or false",
        );
    }
}
