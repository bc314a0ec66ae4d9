//! `justonce.toml` and its `JUSTONCE_*` overrides, turned into validated settings before
//! anything starts.

use anyhow::{Context, Result, anyhow, bail};
use justonce_http::HttpDestination;
use justonce_http::receiver::{IdLocation, Scheme, Source};
use justonce_sql::{Consumer, Retention};
use justonce_transport::KeyFrom;
use justonce_transport::amqp::AmqpOptions;
use justonce_transport::mqtt::MqttOptions;
use justonce_transport::nats::NatsOptions;
use justonce_transport::redis_streams::RedisStreamOptions;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Everything `serve` and the other commands need, checked. Not `Debug`: the database URL
/// may hold a password.
pub struct Settings {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub database: String,
    pub body_limit: usize,
    pub sources: Vec<SourceSettings>,
    pub consumers: Vec<ConsumerSettings>,
}

/// One webhook sender and where its events go, built and checked.
pub struct SourceSettings {
    pub name: String,
    pub source: Source,
    pub retention: Retention,
    pub destination: HttpDestination,
    pub deliver_for: Duration,
}

/// One broker queue and where its messages go, built and checked. Not `Debug`: the broker
/// URL may hold a password.
pub struct ConsumerSettings {
    pub name: String,
    pub from: String,
    pub options: BrokerOptions,
    pub retention: Retention,
    pub destination: HttpDestination,
    pub deliver_for: Duration,
}

/// What to consume, per broker.
#[derive(Debug, Clone)]
pub enum BrokerOptions {
    Amqp(AmqpOptions),
    Nats(NatsOptions),
    Redis(RedisStreamOptions),
    Mqtt(MqttOptions),
}

impl Settings {
    /// The retention the shared store is opened with: every source and consumer keeps its
    /// keys at least this long, and purges each by its own.
    pub fn store_retention(&self) -> Result<Retention> {
        let retentions = || {
            let sources = self.sources.iter().map(|s| s.retention);
            sources.chain(self.consumers.iter().map(|c| c.retention))
        };
        let keep = retentions().map(|r| r.keep()).min();
        let horizon = retentions().map(|r| r.retry_horizon()).min();
        Ok(match (keep, horizon) {
            (Some(keep), Some(horizon)) => Retention::new(keep, horizon)?,
            _ => Retention::default(),
        })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    sources: BTreeMap<String, RawSource>,
    #[serde(default)]
    consumers: BTreeMap<String, RawConsumer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConsumer {
    from: String,
    queue: Option<String>,
    stream: Option<String>,
    subject: Option<String>,
    durable: Option<String>,
    group: Option<String>,
    topic: Option<String>,
    client_id: Option<String>,
    id: Option<String>,
    retry_horizon: Option<String>,
    retention: Option<String>,
    target: String,
    deliver_for: Option<String>,
    target_secret: Option<String>,
    max_attempts: Option<u32>,
    prefetch: Option<u16>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    database: Option<String>,
    body_limit: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    scheme: String,
    #[serde(default)]
    secrets: Vec<String>,
    tolerance: Option<String>,
    retry_horizon: Option<String>,
    retention: Option<String>,
    target: String,
    deliver_for: Option<String>,
    target_secret: Option<String>,
    id: Option<String>,
    signature_header: Option<String>,
}

/// The consumer keys that `JUSTONCE_CONSUMERS_<NAME>_<KEY>` overrides: the text ones.
const CONSUMER_KEYS: [&str; 14] = [
    "from",
    "queue",
    "stream",
    "subject",
    "durable",
    "group",
    "topic",
    "client_id",
    "id",
    "retry_horizon",
    "retention",
    "target",
    "deliver_for",
    "target_secret",
];
const SERVER_KEYS: [&str; 4] = ["listen", "admin_listen", "database", "body_limit"];
const SOURCE_KEYS: [&str; 10] = [
    "scheme",
    "secrets",
    "tolerance",
    "retry_horizon",
    "retention",
    "target",
    "deliver_for",
    "target_secret",
    "id",
    "signature_header",
];

/// Reads `path` (absent is fine: every value has a default or comes from the environment),
/// applies `JUSTONCE_*` overrides from `env`, and validates.
pub fn load(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Settings> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    let mut table: toml::Table =
        toml::from_str(&text).with_context(|| format!("{} is not valid TOML", path.display()))?;
    apply_env(&mut table, env);
    let raw: RawConfig = table
        .try_into()
        .with_context(|| format!("in {}", path.display()))?;
    validate(raw, env)
}

/// `JUSTONCE_SERVER_<KEY>` and `JUSTONCE_SOURCES_<SOURCE>_<KEY>` (upper case, `-` as `_`)
/// override the file. `secrets` takes a comma-separated list.
fn apply_env(table: &mut toml::Table, env: &dyn Fn(&str) -> Option<String>) {
    let variable = |path: &[&str]| {
        format!("JUSTONCE_{}", path.join("_"))
            .to_uppercase()
            .replace('-', "_")
    };
    let server = table
        .entry("server")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let Some(server) = server.as_table_mut() {
        for key in SERVER_KEYS {
            if let Some(value) = env(&variable(&["server", key])) {
                server.insert(key.to_owned(), toml::Value::String(value));
            }
        }
    }
    if let Some(consumers) = table.get_mut("consumers").and_then(|c| c.as_table_mut()) {
        for (name, consumer) in consumers.iter_mut() {
            let Some(consumer) = consumer.as_table_mut() else {
                continue;
            };
            for key in CONSUMER_KEYS {
                if let Some(value) = env(&variable(&["consumers", name, key])) {
                    consumer.insert(key.to_owned(), toml::Value::String(value));
                }
            }
        }
    }
    let Some(sources) = table.get_mut("sources").and_then(|s| s.as_table_mut()) else {
        return;
    };
    for (name, source) in sources.iter_mut() {
        let Some(source) = source.as_table_mut() else {
            continue;
        };
        for key in SOURCE_KEYS {
            let Some(value) = env(&variable(&["sources", name, key])) else {
                continue;
            };
            let value = if key == "secrets" {
                toml::Value::Array(
                    value
                        .split(',')
                        .map(|s| toml::Value::String(s.trim().to_owned()))
                        .collect(),
                )
            } else {
                toml::Value::String(value)
            };
            source.insert(key.to_owned(), value);
        }
    }
}

fn validate(raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Settings> {
    let server = raw.server;
    let address = |value: Option<String>, default: &str, what: &str| -> Result<SocketAddr> {
        let value = value.unwrap_or_else(|| default.to_owned());
        value.parse().map_err(|_| {
            anyhow!("server.{what} {value:?} is not an address such as 127.0.0.1:8080")
        })
    };
    let database = server
        .database
        .unwrap_or_else(|| "sqlite://justonce.db".to_owned());
    if !["sqlite:", "postgres:", "postgresql:", "mysql:"]
        .iter()
        .any(|scheme| database.starts_with(scheme))
    {
        bail!("server.database must be a sqlite://, postgres:// or mysql:// URL");
    }
    let body_limit =
        parse_size(server.body_limit.as_deref().unwrap_or("1MiB")).context("server.body_limit")?;
    let sources = raw
        .sources
        .into_iter()
        .map(|(name, source)| {
            validate_source(&name, source, env).with_context(|| format!("sources.{name}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let consumers = raw
        .consumers
        .into_iter()
        .map(|(name, consumer)| {
            validate_consumer(&name, consumer, env).with_context(|| format!("consumers.{name}"))
        })
        .collect::<Result<Vec<_>>>()?;
    // Sources and consumers share the store's consumer names and the relay's destinations.
    if let Some(both) = consumers
        .iter()
        .find(|c| sources.iter().any(|s| s.name == c.name))
    {
        bail!(
            "{:?} names both a source and a consumer: they share one namespace",
            both.name
        );
    }
    Ok(Settings {
        listen: address(server.listen, "127.0.0.1:8080", "listen")?,
        admin_listen: address(server.admin_listen, "127.0.0.1:9090", "admin_listen")?,
        database,
        body_limit,
        sources,
        consumers,
    })
}

fn validate_consumer(
    name: &str,
    raw: RawConsumer,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ConsumerSettings> {
    Consumer::new(name)?;
    if name.contains(':') || name.contains('/') {
        bail!("consumer name {name:?} may not contain ':' or '/'");
    }
    let from = match raw.from.strip_prefix("env:") {
        Some(_) => resolve_secret(&raw.from, env)?,
        None => raw.from.clone(),
    };
    let scheme = from.split_once("://").map_or("", |(scheme, _)| scheme);
    let (amqp, nats, redis, mqtt) = (
        scheme == "amqp",
        scheme == "nats",
        matches!(scheme, "redis" | "rediss"),
        scheme == "mqtt",
    );
    if !(amqp || nats || redis || mqtt) {
        bail!(
            "from must be an amqp://, nats://, redis:// or mqtt:// URL (or env:VARIABLE \
             holding one): RabbitMQ, NATS JetStream, Redis Streams and MQTT are the brokers \
             this version consumes"
        );
    }
    let only = |present: bool, key: &str, broker: &str| -> Result<()> {
        if present {
            bail!("{key} only applies to {broker} consumers");
        }
        Ok(())
    };
    only(!amqp && raw.queue.is_some(), "queue", "RabbitMQ")?;
    only(!amqp && raw.prefetch.is_some(), "prefetch", "RabbitMQ")?;
    only(!nats && raw.subject.is_some(), "subject", "NATS")?;
    only(!nats && raw.durable.is_some(), "durable", "NATS")?;
    only(!redis && raw.group.is_some(), "group", "Redis Streams")?;
    only(
        !(nats || redis) && raw.stream.is_some(),
        "stream",
        "NATS and Redis Streams",
    )?;
    only(!mqtt && raw.topic.is_some(), "topic", "MQTT")?;
    only(!mqtt && raw.client_id.is_some(), "client_id", "MQTT")?;
    let key_from = match raw.id.as_deref().unwrap_or("message_id") {
        "message_id" => KeyFrom::MessageId,
        id => match id.split_once(':') {
            Some(("header", header)) if !header.is_empty() => KeyFrom::Header(header.to_owned()),
            Some(("json", pointer)) if pointer.starts_with('/') => {
                KeyFrom::Json(pointer.to_owned())
            }
            _ => bail!("id {id:?} must be \"message_id\", \"header:NAME\" or \"json:/POINTER\""),
        },
    };
    let duration = |value: Option<&str>, default: &str, what: &str| {
        parse_duration(value.unwrap_or(default)).with_context(|| what.to_owned())
    };
    let retry_horizon = duration(raw.retry_horizon.as_deref(), "3d", "retry_horizon")?;
    let keep = duration(raw.retention.as_deref(), "7d", "retention")?;
    let retention = Retention::new(keep, retry_horizon)?;
    let deliver_for = duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
    let stream = || {
        raw.stream
            .clone()
            .filter(|s| !s.is_empty())
            .context("stream must name a stream")
    };
    let options = if nats {
        let stream = stream()?;
        let subject = raw.subject.unwrap_or_else(|| stream.clone());
        let mut options = NatsOptions::new(&stream, subject)
            .key_from(key_from)
            .durable(raw.durable.unwrap_or_else(|| name.to_owned()));
        if let Some(attempts) = raw.max_attempts {
            options = options.max_attempts(attempts);
        }
        BrokerOptions::Nats(options)
    } else if redis {
        let group = raw.group.clone().unwrap_or_else(|| name.to_owned());
        let mut options = RedisStreamOptions::new(stream()?, group).key_from(key_from);
        if let Some(attempts) = raw.max_attempts {
            options = options.max_attempts(attempts);
        }
        BrokerOptions::Redis(options)
    } else if mqtt {
        let topic = raw
            .topic
            .clone()
            .filter(|t| !t.is_empty())
            .context("topic must name a topic filter")?;
        let client_id = raw
            .client_id
            .clone()
            .unwrap_or_else(|| format!("justonce-{name}"));
        let mut options = MqttOptions::new(topic, client_id).key_from(key_from);
        if let Some(attempts) = raw.max_attempts {
            options = options.max_attempts(attempts);
        }
        BrokerOptions::Mqtt(options)
    } else {
        let queue = raw
            .queue
            .filter(|q| !q.is_empty())
            .context("queue must name a queue")?;
        let mut options = AmqpOptions::new(&queue).key_from(key_from);
        if let Some(attempts) = raw.max_attempts {
            options = options.max_attempts(attempts);
        }
        if let Some(prefetch) = raw.prefetch {
            options = options.prefetch(prefetch);
        }
        BrokerOptions::Amqp(options)
    };
    Ok(ConsumerSettings {
        name: name.to_owned(),
        from,
        options,
        retention,
        destination: destination(&raw.target, raw.target_secret.as_deref(), env)?,
        deliver_for,
    })
}

/// The HTTP target of a source or consumer, signed when it has a secret.
fn destination(
    target: &str,
    secret: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<HttpDestination> {
    let mut destination = HttpDestination::new(target).context("target")?;
    if let Some(reference) = secret {
        destination = destination
            .signed_with(&resolve_secret(reference, env)?)
            .context("target_secret")?;
    }
    Ok(destination)
}

fn validate_source(
    name: &str,
    raw: RawSource,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<SourceSettings> {
    let duration = |value: Option<&str>, default: &str, what: &str| {
        parse_duration(value.unwrap_or(default)).with_context(|| what.to_owned())
    };
    let signs_a_timestamp = matches!(raw.scheme.as_str(), "standard-webhooks" | "stripe");
    if raw.tolerance.is_some() && !signs_a_timestamp {
        bail!("tolerance only applies to standard-webhooks and stripe, which sign a timestamp");
    }
    if raw.signature_header.is_some() && raw.scheme != "hmac-sha256" {
        bail!("signature_header only applies to hmac-sha256");
    }
    let tolerance = duration(raw.tolerance.as_deref(), "5m", "tolerance")?;
    if tolerance.is_zero() {
        bail!("tolerance must be more than zero");
    }
    let retry_horizon = duration(raw.retry_horizon.as_deref(), "3d", "retry_horizon")?;
    let keep = duration(raw.retention.as_deref(), "7d", "retention")?;
    let retention = Retention::new(keep, retry_horizon)?;
    let deliver_for = duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
    let secrets = raw
        .secrets
        .iter()
        .map(|reference| resolve_secret(reference, env))
        .collect::<Result<Vec<_>>>()?;
    match (raw.scheme.as_str(), secrets.is_empty()) {
        ("none", false) => bail!("scheme none takes no secrets"),
        ("none", true) => {}
        (scheme, true) => bail!("scheme {scheme} needs at least one secret"),
        _ => {}
    }
    let as_bytes = || {
        secrets
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect::<Vec<_>>()
    };
    let (scheme, default_id) = match raw.scheme.as_str() {
        "standard-webhooks" => (
            Scheme::standard_webhooks(&secrets, tolerance)?,
            Some("header:webhook-id"),
        ),
        "stripe" => (
            Scheme::Stripe {
                secrets: as_bytes(),
                tolerance,
            },
            Some("json:/id"),
        ),
        "github" => (
            Scheme::Github {
                secrets: as_bytes(),
            },
            Some("header:X-GitHub-Delivery"),
        ),
        "hmac-sha256" => {
            let header = raw.signature_header.as_deref().unwrap_or("X-Signature");
            axum::http::HeaderName::try_from(header)
                .map_err(|_| anyhow!("signature_header {header:?} is not a header name"))?;
            let scheme = Scheme::HmacSha256 {
                secrets: as_bytes(),
                header: header.to_ascii_lowercase(),
            };
            (scheme, None)
        }
        "none" => (Scheme::None, None),
        other => bail!(
            "scheme {other:?} is not one of standard-webhooks, stripe, github, hmac-sha256, none"
        ),
    };
    let id = raw.id.as_deref().or(default_id).ok_or_else(|| {
        anyhow!(
            "scheme {} needs id = \"header:NAME\" or \"json:/POINTER\"",
            raw.scheme
        )
    })?;
    let id = match id.split_once(':') {
        Some(("header", header)) => IdLocation::Header(
            header
                .parse()
                .map_err(|_| anyhow!("id header {header:?} is not a header name"))?,
        ),
        Some(("json", pointer)) if pointer.starts_with('/') => IdLocation::Json(pointer.to_owned()),
        _ => bail!("id {id:?} must be \"header:NAME\" or \"json:/POINTER\""),
    };
    Ok(SourceSettings {
        name: name.to_owned(),
        source: Source::new(name, scheme, id)?,
        retention,
        destination: destination(&raw.target, raw.target_secret.as_deref(), env)?,
        deliver_for,
    })
}

/// Secrets are references to environment variables (`env:NAME`), so that the file holds
/// none and no log prints one.
fn resolve_secret(reference: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String> {
    let Some(variable) = reference.strip_prefix("env:") else {
        bail!("secrets are written env:VARIABLE, not given in the file");
    };
    match env(variable) {
        Some(secret) if !secret.is_empty() => Ok(secret),
        Some(_) => bail!("the environment variable {variable} is empty"),
        None => bail!("the environment variable {variable} is not set"),
    }
}

/// `90s`, `5m`, `36h`, `7d`, `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| anyhow!("{text:?} needs a unit: ms, s, m, h or d"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| anyhow!("{text:?} is not a duration such as 5m or 3d"))?;
    let seconds = match unit {
        "ms" => return Ok(Duration::from_millis(number)),
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => bail!("{text:?} has an unknown unit: use ms, s, m, h or d"),
    };
    Ok(Duration::from_secs(number.saturating_mul(seconds)))
}

/// `1048576`, `512KiB`, `1MiB`, `2MB`.
pub fn parse_size(text: &str) -> Result<usize> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: usize = number
        .parse()
        .map_err(|_| anyhow!("{text:?} is not a size such as 1MiB"))?;
    let unit_bytes = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        _ => bail!("{text:?} has an unknown unit: use B, KiB, MiB, GiB, KB, MB or GB"),
    };
    number
        .checked_mul(unit_bytes)
        .ok_or_else(|| anyhow!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn load_text(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Settings> {
        let path = write_temporary(text);
        let settings = load(&path, env);
        let _ = std::fs::remove_file(path);
        settings
    }

    fn error_of(text: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
        match load_text(text, env) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(error) => format!("{error:#}"),
        }
    }

    fn write_temporary(text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("justonce-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{n}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    const SHOP: &str = r#"
[server]
listen = "127.0.0.1:8080"
body_limit = "64KiB"

[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:SHOP_SECRET"]
target = "http://127.0.0.1:9000/hooks/shop"
"#;

    #[test]
    fn a_file_with_defaults_and_overrides() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_LISTEN", "127.0.0.1:18080"),
            ("JUSTONCE_SOURCES_SHOP_RETENTION", "10d"),
        ]);
        let settings = load_text(SHOP, &env).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:18080".parse().unwrap());
        assert_eq!(settings.admin_listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(settings.database, "sqlite://justonce.db");
        assert_eq!(settings.body_limit, 64 * 1024);
        let shop = &settings.sources[0];
        assert_eq!(shop.source.name(), "shop");
        assert_eq!(shop.retention.keep(), Duration::from_secs(10 * 86_400));
        assert_eq!(shop.deliver_for, Duration::from_secs(3 * 86_400));
    }

    #[test]
    fn mistakes_are_named() {
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        let cases = [
            (SHOP.replace("listen =", "lisen ="), "lisen"),
            (
                SHOP.replace("env:SHOP_SECRET", "whsec_inline"),
                "env:VARIABLE",
            ),
            (
                SHOP.replace("SHOP_SECRET", "MISSING_SECRET"),
                "MISSING_SECRET",
            ),
            (SHOP.replace("standard-webhooks", "magic"), "magic"),
            (format!("{SHOP}retention = \"1d\"\n"), "retry horizon"),
            (SHOP.replace("64KiB", "64 parsecs"), "body_limit"),
            (format!("{SHOP}tolerance = \"5\"\n"), "unit"),
            (SHOP.replace("standard-webhooks", "hmac-sha256"), "id ="),
            (
                SHOP.replace("http://127.0.0.1:9000/hooks/shop", "ftp://x"),
                "target",
            ),
            (format!("{SHOP}tolerance = \"0s\"\n"), "more than zero"),
            (
                SHOP.replace("standard-webhooks", "github") + "tolerance = \"1m\"\n",
                "tolerance",
            ),
            (
                format!("{SHOP}signature_header = \"X-Sig\"\n"),
                "signature_header",
            ),
            (
                SHOP.replace("[sources.shop]", "[sources.\"a:b\"]"),
                "may not contain",
            ),
        ];
        for (text, expected) in cases {
            let error = error_of(&text, &env);
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
            assert!(!error.contains("c2VjcmV0"), "a secret was printed: {error}");
        }
    }

    #[test]
    fn empty_secrets_are_refused() {
        let env = env_of(&[("SHOP_SECRET", "")]);
        let error = error_of(SHOP, &env);
        assert!(error.contains("SHOP_SECRET is empty"), "{error}");
        let none = SHOP.replace("standard-webhooks", "none");
        let env = env_of(&[("SHOP_SECRET", "x")]);
        let error = error_of(&none, &env);
        assert!(error.contains("takes no secrets"), "{error}");
    }

    const ORDERS: &str = r#"
[consumers.orders]
from = "env:ORDERS_BROKER"
queue = "orders"
id = "header:X-Order-Id"
max_attempts = 3
target = "http://127.0.0.1:9000/orders"
"#;

    #[test]
    fn consumers_are_read_and_checked() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
            ("JUSTONCE_CONSUMERS_ORDERS_QUEUE", "orders-eu"),
        ]);
        let settings = load_text(&format!("{SHOP}{ORDERS}"), &env).unwrap();
        let [orders] = settings.consumers.as_slice() else {
            panic!("one consumer");
        };
        assert_eq!(orders.name, "orders");
        assert_eq!(orders.from, "amqp://guest:hunter2@127.0.0.1:5672/%2f");
        assert!(format!("{:?}", orders.options).contains("orders-eu"));
        let cases = [
            (
                ORDERS.replace("env:ORDERS_BROKER", "kafka://127.0.0.1:9092"),
                "amqp://, nats://, redis:// or mqtt://",
            ),
            (
                ORDERS.replace("env:ORDERS_BROKER", "redis://127.0.0.1:6379"),
                "queue only applies",
            ),
            (
                ORDERS.replace("queue = \"orders\"", "group = \"g\""),
                "group only applies",
            ),
            (
                ORDERS.replace("env:ORDERS_BROKER", "nats://127.0.0.1:4222"),
                "queue only applies",
            ),
            (ORDERS.replace("header:X-Order-Id", "body"), "message_id"),
            (
                ORDERS.replace("[consumers.orders]", "[consumers.shop]"),
                "both a source and a consumer",
            ),
            (ORDERS.replace("queue = \"orders\"\n", ""), "queue"),
            (format!("{ORDERS}retention = \"1h\"\n"), "retry horizon"),
        ];
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
        ]);
        for (consumer, expected) in cases {
            let error = error_of(&format!("{SHOP}{consumer}"), &env);
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
            assert!(
                !error.contains("hunter2"),
                "a password was printed: {error}"
            );
        }
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("3d").unwrap(), Duration::from_secs(259_200));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("3 weeks").is_err());
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("-1").is_err());
    }
}
