//! A broker consumer: which broker its URL names and the settings that broker takes.

use super::entry::{Entry, TenantSetting};
use super::secret::resolve_secret;
use super::tls::{consumer_tls, with_tls};
use crate::config::read::{Env, Origin, RawConsumer};
use crate::config::settings::{BrokerOptions, ConsumerSettings};
use anyhow::{Context, Result, anyhow, bail};
use justonce_sql::{Consumer, Scope};
use justonce_transport::amqp::{AmqpOptions, QueueType};
use justonce_transport::kafka::{KafkaOptions, Sasl, SaslMechanism};
use justonce_transport::mqtt::MqttOptions;
use justonce_transport::nats::NatsOptions;
use justonce_transport::redis_streams::RedisStreamOptions;
use justonce_transport::tls::Tls;
use justonce_transport::{KeyFrom, Tenants};
use std::time::Duration;

/// The broker a consumer's URL names, read once from its scheme: every later choice
/// matches on it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Broker {
    RabbitMq,
    Nats,
    Redis,
    Mqtt,
    Kafka,
}

impl Broker {
    /// The broker of `url`'s scheme, and whether the scheme connects over TLS or, for NATS
    /// and Kafka, may (the TLS settings then require it of the server); `None` for another
    /// scheme.
    fn of(url: &str) -> Option<(Self, bool)> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        Some(match scheme {
            "amqp" => (Broker::RabbitMq, false),
            "amqps" => (Broker::RabbitMq, true),
            "nats" => (Broker::Nats, true),
            "redis" => (Broker::Redis, false),
            "rediss" => (Broker::Redis, true),
            "mqtt" => (Broker::Mqtt, false),
            "mqtts" => (Broker::Mqtt, true),
            "kafka" => (Broker::Kafka, true),
            _ => return None,
        })
    }

    /// How errors name the broker.
    fn name(self) -> &'static str {
        match self {
            Broker::RabbitMq => "RabbitMQ",
            Broker::Nats => "NATS",
            Broker::Redis => "Redis Streams",
            Broker::Mqtt => "MQTT",
            Broker::Kafka => "Kafka",
        }
    }
}

/// The consumer `name` as written, checked: its broker, the options that broker takes, its
/// TLS and its target.
pub fn validate_consumer(
    name: &str,
    raw: RawConsumer,
    longest_timeout: Duration,
    env: &Env,
    origin: &Origin<'_>,
) -> Result<ConsumerSettings> {
    let entry = Entry::new("consumers", name, longest_timeout, env, origin);
    let at = |key| entry.at(key);
    Consumer::new(name).with_context(|| entry.named())?;
    if name.contains(':') || name.contains('/') {
        bail!(
            "{}: a consumer's name may not contain ':' or '/'",
            entry.named()
        );
    }
    let from = match raw.from.strip_prefix("env:") {
        Some(_) => resolve_secret(&raw.from, env).with_context(|| at("from"))?,
        None => raw.from.clone(),
    };
    let Some((broker, over_tls)) = Broker::of(&from) else {
        bail!(
            "{}: must be an amqp://, nats://, redis://, mqtt:// or kafka:// URL (amqps://, \
             rediss:// and mqtts:// over TLS), or env:VARIABLE holding one: RabbitMQ, NATS \
             JetStream, Redis Streams, MQTT and Kafka are the brokers this version consumes",
            at("from")
        );
    };
    let tls = consumer_tls(&raw, over_tls, env, &at)?;
    // The keys that only some brokers take, in the order they are checked.
    let broker_keys: [(&'static str, bool, &[Broker]); 14] = [
        ("queue", raw.queue.is_some(), &[Broker::RabbitMq]),
        ("queue_type", raw.queue_type.is_some(), &[Broker::RabbitMq]),
        (
            "delivery_limit",
            raw.delivery_limit.is_some(),
            &[Broker::RabbitMq],
        ),
        (
            "prefetch",
            raw.prefetch.is_some(),
            &[Broker::RabbitMq, Broker::Nats],
        ),
        ("subject", raw.subject.is_some(), &[Broker::Nats]),
        ("replicas", raw.replicas.is_some(), &[Broker::Nats]),
        ("durable", raw.durable.is_some(), &[Broker::Nats]),
        (
            "group",
            raw.group.is_some(),
            &[Broker::Redis, Broker::Kafka],
        ),
        (
            "stream",
            raw.stream.is_some(),
            &[Broker::Nats, Broker::Redis],
        ),
        ("topic", raw.topic.is_some(), &[Broker::Mqtt, Broker::Kafka]),
        ("client_id", raw.client_id.is_some(), &[Broker::Mqtt]),
        (
            "sasl_mechanism",
            raw.sasl_mechanism.is_some(),
            &[Broker::Kafka],
        ),
        (
            "sasl_username",
            raw.sasl_username.is_some(),
            &[Broker::Kafka],
        ),
        (
            "sasl_password",
            raw.sasl_password.is_some(),
            &[Broker::Kafka],
        ),
    ];
    for (key, present, brokers) in broker_keys {
        if present && !brokers.contains(&broker) {
            let names: Vec<&str> = brokers.iter().map(|b| b.name()).collect();
            bail!(
                "{}: only applies to {} consumers",
                at(key),
                names.join(" and ")
            );
        }
    }
    let sasl = kafka_sasl(&raw, env, &at)?;
    let key_from = match entry.or_default("id", raw.id.as_deref(), "message_id") {
        "message_id" => KeyFrom::MessageId,
        id => located(id).map_err(|_| {
            anyhow!(
                "{}: {id:?} must be \"message_id\", \"header:NAME\" or \"json:/POINTER\"",
                at("id")
            )
        })?,
    };
    // A fixed tenant is the inbox's scope; one the message names is read per message.
    let (tenant, tenants) =
        match entry.tenant(raw.tenant.as_deref(), raw.tenants.as_deref(), located)? {
            None => (None, None),
            Some(TenantSetting::Fixed(tenant)) => (
                Some(Scope::new(tenant).with_context(|| at("tenant"))?),
                None,
            ),
            Some(TenantSetting::Named { location, allowed }) => (
                None,
                Some(
                    Tenants::new(location, allowed.iter().cloned())
                        .with_context(|| at("tenants"))?,
                ),
            ),
        };
    let tenants_taken = tenants.clone();
    let retention = entry.retention(raw.retry_horizon.as_deref(), raw.retention.as_deref())?;
    let event_retention = entry.event_retention(
        raw.event_retention.as_deref(),
        raw.retention.as_deref(),
        retention,
    )?;
    let deliver_for = entry.duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
    let max_attempts = raw
        .max_attempts
        .map(|count| u32::try_from(count.0))
        .transpose()
        .map_err(|_| anyhow!("{}: must be at most {}", at("max_attempts"), u32::MAX))?;
    let prefetch = raw
        .prefetch
        .map(|count| u16::try_from(count.0))
        .transpose()
        .map_err(|_| anyhow!("{}: must be at most {}", at("prefetch"), u16::MAX))?;
    // JetStream keeps at most 5 copies of a stream.
    let replicas = raw
        .replicas
        .map(|count| {
            usize::try_from(count.0)
                .ok()
                .filter(|replicas| (1..=5).contains(replicas))
                .ok_or_else(|| anyhow!("{}: must be from 1 to 5", at("replicas")))
        })
        .transpose()?;
    // The defaults that are the consumer's own name.
    let or_name =
        |value: Option<&str>, key: &'static str| entry.or_default(key, value, name).to_owned();
    let stream = || {
        raw.stream
            .clone()
            .filter(|s| !s.is_empty())
            .with_context(|| format!("{}: must name a stream", at("stream")))
    };
    let topic = || {
        raw.topic
            .clone()
            .filter(|t| !t.is_empty())
            .with_context(|| format!("{}: must name a topic", at("topic")))
    };
    let options = match broker {
        Broker::Kafka => {
            if key_from == KeyFrom::MessageId {
                bail!(
                    "{}: a Kafka record carries no message id (its key names an entity, not a \
                     message): set id = \"header:NAME\" (such as header:ce_id) or \
                     \"json:/POINTER\"",
                    at("id")
                );
            }
            let group = or_name(raw.group.as_deref(), "group");
            let mut options = KafkaOptions::new(topic()?, group).key_from(key_from);
            if let Some(tenants) = tenants {
                options = options.tenants(tenants);
            }
            if let Some(attempts) = max_attempts {
                options = options.max_attempts(attempts);
            }
            if let Some(sasl) = sasl {
                options = options.sasl(sasl);
            }
            BrokerOptions::Kafka(with_tls(options, &tls, KafkaOptions::tls))
        }
        Broker::Nats => {
            let stream = stream()?;
            let subject = entry.or_default("subject", raw.subject.as_deref(), &stream);
            let mut options = NatsOptions::new(&stream, subject)
                .key_from(key_from)
                .durable(or_name(raw.durable.as_deref(), "durable"));
            if let Some(tenants) = tenants {
                options = options.tenants(tenants);
            }
            if let Some(attempts) = max_attempts {
                options = options.max_attempts(attempts);
            }
            if let Some(prefetch) = prefetch {
                options = options.prefetch(usize::from(prefetch));
            }
            if let Some(replicas) = replicas {
                options = options.replicas(replicas);
            }
            BrokerOptions::Nats(with_tls(options, &tls, NatsOptions::tls))
        }
        Broker::Redis => {
            let group = or_name(raw.group.as_deref(), "group");
            let mut options = RedisStreamOptions::new(stream()?, group).key_from(key_from);
            if let Some(tenants) = tenants {
                options = options.tenants(tenants);
            }
            if let Some(attempts) = max_attempts {
                options = options.max_attempts(attempts);
            }
            BrokerOptions::Redis(with_tls(options, &tls, RedisStreamOptions::tls))
        }
        Broker::Mqtt => {
            let topic = topic()?;
            let default_client_id = format!("justonce-{name}");
            let client_id =
                entry.or_default("client_id", raw.client_id.as_deref(), &default_client_id);
            let mut options = MqttOptions::new(topic, client_id).key_from(key_from);
            if let Some(tenants) = tenants {
                options = options.tenants(tenants);
            }
            if let Some(attempts) = max_attempts {
                options = options.max_attempts(attempts);
            }
            BrokerOptions::Mqtt(with_tls(options, &tls, MqttOptions::tls))
        }
        Broker::RabbitMq => {
            let queue = raw
                .queue
                .filter(|q| !q.is_empty())
                .with_context(|| format!("{}: must name a queue", at("queue")))?;
            let queue_type =
                match entry.or_default("queue_type", raw.queue_type.as_deref(), "classic") {
                    "classic" => QueueType::Classic,
                    "quorum" => QueueType::Quorum,
                    other => bail!(
                        "{}: {other:?} must be \"classic\" or \"quorum\"",
                        at("queue_type")
                    ),
                };
            let mut options = AmqpOptions::new(&queue)
                .key_from(key_from)
                .queue_type(queue_type);
            if let Some(limit) = raw.delivery_limit {
                // Only a quorum queue has a delivery limit: a classic one would ignore it.
                if queue_type != QueueType::Quorum {
                    bail!("{}: needs queue_type = \"quorum\"", at("delivery_limit"));
                }
                let limit = u32::try_from(limit.0)
                    .ok()
                    .filter(|limit| *limit >= 1)
                    .ok_or_else(|| {
                        anyhow!("{}: must be from 1 to {}", at("delivery_limit"), u32::MAX)
                    })?;
                options = options.delivery_limit(limit);
            }
            if let Some(tenants) = tenants {
                options = options.tenants(tenants);
            }
            if let Some(attempts) = max_attempts {
                options = options.max_attempts(attempts);
            }
            if let Some(prefetch) = prefetch {
                options = options.prefetch(prefetch);
            }
            BrokerOptions::Amqp(with_tls(options, &tls, AmqpOptions::tls))
        }
    };
    let destination = entry.destination(&raw.target, &raw.target_secret, &raw.timeout)?;
    Ok(ConsumerSettings {
        name: name.to_owned(),
        from,
        options,
        tls_insecure: tls.as_ref().is_some_and(Tls::is_insecure),
        retention,
        event_retention,
        destination,
        deliver_for,
        tenant,
        tenants: tenants_taken,
    })
}

/// Where a message holds its id or tenant, as `id` and `tenant` spell it: `header:NAME` or
/// `json:/POINTER`.
fn located(text: &str) -> Result<KeyFrom, String> {
    match text.split_once(':') {
        Some(("header", header)) if !header.is_empty() => Ok(KeyFrom::Header(header.to_owned())),
        Some(("json", pointer)) if pointer.starts_with('/') => {
            Ok(KeyFrom::Json(pointer.to_owned()))
        }
        _ => Err(format!(
            "{text:?} must be \"header:NAME\" or \"json:/POINTER\""
        )),
    }
}

/// The SASL settings of a Kafka consumer: all three, or none. The password is a reference
/// to an environment variable, never written in the file.
fn kafka_sasl(
    raw: &RawConsumer,
    env: &Env,
    at: &dyn Fn(&'static str) -> String,
) -> Result<Option<Sasl>> {
    let (mechanism, username, password) =
        match (&raw.sasl_mechanism, &raw.sasl_username, &raw.sasl_password) {
            (None, None, None) => return Ok(None),
            (Some(mechanism), Some(username), Some(password)) => (mechanism, username, password),
            _ => bail!(
                "{}: SASL needs sasl_mechanism, sasl_username and sasl_password together",
                at("sasl_mechanism")
            ),
        };
    let mechanism = match mechanism.as_str() {
        "PLAIN" => SaslMechanism::Plain,
        "SCRAM-SHA-256" => SaslMechanism::ScramSha256,
        "SCRAM-SHA-512" => SaslMechanism::ScramSha512,
        other => bail!(
            "{}: {other:?} must be \"PLAIN\", \"SCRAM-SHA-256\" or \"SCRAM-SHA-512\"",
            at("sasl_mechanism")
        ),
    };
    if !password.starts_with("env:") {
        bail!(
            "{}: must be env:VARIABLE, the variable that holds the password",
            at("sasl_password")
        );
    }
    let password = resolve_secret(password, env).with_context(|| at("sasl_password"))?;
    Ok(Some(Sasl::new(mechanism, username, password)))
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{ORDERS, SHOP, env_of, error_of, load_text};

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
        let kafka = ORDERS
            .replace("env:ORDERS_BROKER", "kafka://127.0.0.1:9092")
            .replace(
                "queue = \"orders\"",
                "topic = \"orders\"\ngroup = \"billing\"\nsasl_mechanism = \"SCRAM-SHA-512\"\n\
                 sasl_username = \"u\"\nsasl_password = \"env:KAFKA_PASSWORD\"",
            );
        let env_kafka = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("KAFKA_PASSWORD", "hunter2"),
        ]);
        let settings = load_text(&format!("{SHOP}{kafka}"), &env_kafka).unwrap();
        let options = format!("{:?}", settings.consumers[0].options);
        for part in ["Kafka", "\"orders\"", "\"billing\"", "ScramSha512"] {
            assert!(options.contains(part), "{part} not in {options}");
        }
        assert!(!options.contains("hunter2"), "a password was printed");
        let cases = [
            (
                ORDERS.replace("env:ORDERS_BROKER", "pulsar://127.0.0.1:6650"),
                "amqp://, nats://, redis://, mqtt:// or kafka://",
            ),
            (
                ORDERS
                    .replace("env:ORDERS_BROKER", "kafka://127.0.0.1:9092")
                    .replace("queue = \"orders\"", "topic = \"orders\"")
                    .replace("header:X-Order-Id", "message_id"),
                "a Kafka record carries no message id",
            ),
            (
                ORDERS
                    .replace("env:ORDERS_BROKER", "kafka://127.0.0.1:9092")
                    .replace(
                        "queue = \"orders\"",
                        "topic = \"orders\"\nsasl_username = \"u\"",
                    ),
                "SASL needs sasl_mechanism, sasl_username and sasl_password together",
            ),
            (
                ORDERS.replace("env:ORDERS_BROKER", "redis://127.0.0.1:6379"),
                "consumers.orders.queue (line 13): only applies to RabbitMQ",
            ),
            (
                ORDERS.replace("queue = \"orders\"", "group = \"g\""),
                "consumers.orders.group (line 13): only applies to Redis Streams",
            ),
            (
                ORDERS.replace("env:ORDERS_BROKER", "nats://127.0.0.1:4222"),
                "consumers.orders.queue (line 13): only applies to RabbitMQ",
            ),
            (
                ORDERS.replace(
                    "queue = \"orders\"",
                    "queue = \"orders\"\nqueue_type = \"stream\"",
                ),
                "consumers.orders.queue_type (line 14): \"stream\" must be \"classic\" or \"quorum\"",
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
    fn a_delivery_limit_needs_a_quorum_queue() {
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        let amqp = |settings: &str| {
            let consumer = ORDERS
                .replace("env:ORDERS_BROKER", "amqp://127.0.0.1:5672/%2f")
                .replace(
                    "queue = \"orders\"",
                    &format!("queue = \"orders\"\n{settings}"),
                );
            format!("{SHOP}{consumer}")
        };
        let settings =
            load_text(&amqp("queue_type = \"quorum\"\ndelivery_limit = 20"), &env).unwrap();
        let options = format!("{:?}", settings.consumers[0].options);
        assert!(options.contains("delivery_limit: Some(20)"), "{options}");
        let error = error_of(&amqp("delivery_limit = 20"), &env);
        assert!(
            error.contains(
                "consumers.orders.delivery_limit (line 14): needs queue_type = \"quorum\""
            ),
            "{error}"
        );
        let error = error_of(&amqp("queue_type = \"quorum\"\ndelivery_limit = 0"), &env);
        assert!(
            error.contains("consumers.orders.delivery_limit (line 15): must be from 1 to"),
            "{error}"
        );
    }

    #[test]
    fn replicas_are_from_1_to_5_on_nats_only() {
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        let nats = |replicas: &str| {
            let consumer = ORDERS
                .replace(
                    "env:ORDERS_BROKER",
                    "nats://127.0.0.1:4222,nats://127.0.0.1:4223",
                )
                .replace(
                    "queue = \"orders\"",
                    &format!("stream = \"ORDERS\"\nreplicas = {replicas}"),
                );
            format!("{SHOP}{consumer}")
        };
        let settings = load_text(&nats("3"), &env).unwrap();
        let options = format!("{:?}", settings.consumers[0].options);
        assert!(options.contains("replicas: 3"), "{options}");
        assert_eq!(
            settings.consumers[0].from,
            "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
        );
        for replicas in ["0", "6"] {
            let error = error_of(&nats(replicas), &env);
            assert!(
                error.contains("consumers.orders.replicas (line 14): must be from 1 to 5"),
                "{error}"
            );
        }
        let amqp = ORDERS.replace("env:ORDERS_BROKER", "amqp://127.0.0.1:5672/%2f");
        let error = error_of(&format!("{SHOP}{amqp}replicas = 3\n"), &env);
        assert!(
            error.contains("consumers.orders.replicas (line 17): only applies to NATS"),
            "{error}"
        );
    }
}
