//! The raw document: what `justonce.toml` and the variables may hold, as written, before
//! any value is checked. Each section's struct is the one list of its keys.

use serde::Deserialize;
use std::collections::BTreeMap;

/// The whole file.
#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    expecting = "a table of server, sources and consumers"
)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub sources: BTreeMap<String, RawSource>,
    #[serde(default)]
    pub consumers: BTreeMap<String, RawConsumer>,
}

/// One `[consumers.NAME]` table, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table of consumer settings")]
pub struct RawConsumer {
    pub from: String,
    pub queue: Option<String>,
    pub queue_type: Option<String>,
    pub stream: Option<String>,
    pub subject: Option<String>,
    pub durable: Option<String>,
    pub group: Option<String>,
    pub topic: Option<String>,
    pub client_id: Option<String>,
    pub id: Option<String>,
    pub retry_horizon: Option<String>,
    pub retention: Option<String>,
    pub event_retention: Option<String>,
    pub target: String,
    pub timeout: Option<String>,
    pub deliver_for: Option<String>,
    pub target_secret: Option<String>,
    pub max_attempts: Option<Count>,
    pub prefetch: Option<Count>,
    pub replicas: Option<Count>,
    pub delivery_limit: Option<Count>,
    pub tls_ca: Option<String>,
    pub tls_cert: Option<String>,
    pub tls_key: Option<String>,
    pub tls_verify: Option<String>,
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<String>,
    pub tenant: Option<String>,
    pub tenants: Option<Vec<String>>,
}

/// The `[server]` table, as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a table of server settings")]
pub struct RawServer {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub database: Option<String>,
    pub body_limit: Option<String>,
    pub relay_lease: Option<String>,
    pub relay_per_destination: Option<Count>,
    pub relay_per_destination_total: Option<Count>,
    pub purge_every: Option<String>,
    pub roles: Option<String>,
    pub header_timeout: Option<String>,
    pub request_timeout: Option<String>,
    pub max_connections: Option<Count>,
    pub max_requests: Option<Count>,
    pub pool_size: Option<Count>,
    pub acquire_timeout: Option<String>,
    pub share_commits: Option<Switch>,
    pub log_format: Option<String>,
    pub otlp_endpoint: Option<String>,
    pub admin_token: Option<String>,
}

/// A whole number written as a TOML integer or, from a variable, as text.
pub struct Count(pub u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a whole number")
            }
            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<Count, E> {
                Ok(Count(value))
            }
            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<Count, E> {
                u64::try_from(value)
                    .map(Count)
                    .map_err(|_| E::custom("must not be negative"))
            }
            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<Count, E> {
                value
                    .trim()
                    .parse()
                    .map(Count)
                    .map_err(|_| E::custom(format!("{value:?} is not a whole number")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// `true` or `false`, written as a TOML boolean or, from a variable, as text.
pub struct Switch(pub bool);

impl<'de> Deserialize<'de> for Switch {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Switch;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("true or false")
            }
            fn visit_bool<E: serde::de::Error>(self, value: bool) -> Result<Switch, E> {
                Ok(Switch(value))
            }
            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<Switch, E> {
                match value.trim() {
                    "true" => Ok(Switch(true)),
                    "false" => Ok(Switch(false)),
                    _ => Err(E::custom(format!("{value:?} is not true or false"))),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// One `[sources.NAME]` table, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table of source settings")]
pub struct RawSource {
    pub scheme: String,
    #[serde(default)]
    pub secrets: Vec<String>,
    pub tolerance: Option<String>,
    pub retry_horizon: Option<String>,
    pub retention: Option<String>,
    pub event_retention: Option<String>,
    pub target: String,
    pub timeout: Option<String>,
    pub deliver_for: Option<String>,
    pub target_secret: Option<String>,
    pub id: Option<String>,
    pub signature_header: Option<String>,
    pub tenant: Option<String>,
    pub tenants: Option<Vec<String>>,
    pub tenant_secrets: Option<BTreeMap<String, Vec<String>>>,
}

/// The keys of a section, read from its struct's fields: adding a field is all it takes for
/// the file, its variable, `justonce config` and the unknown-variable check to know a key.
pub fn keys_of<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    /// A deserializer that only records the fields a struct asks for.
    struct Fields<'a>(&'a mut &'static [&'static str]);
    impl<'de> serde::Deserializer<'de> for Fields<'_> {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("fields read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    fields
}

/// The sections whose entries are named, with their keys.
pub fn named_sections() -> [(&'static str, &'static [&'static str]); 2] {
    [
        ("sources", keys_of::<RawSource>()),
        ("consumers", keys_of::<RawConsumer>()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of a section is a key its variables set: the struct is the only list.
    #[test]
    fn the_keys_are_the_fields_of_each_section() {
        let consumer = keys_of::<RawConsumer>();
        for key in ["from", "client_id", "id", "max_attempts", "prefetch"] {
            assert!(consumer.contains(&key), "{key}: {consumer:?}");
        }
        assert!(keys_of::<RawServer>().contains(&"pool_size"));
        assert!(keys_of::<RawSource>().contains(&"signature_header"));
        assert_eq!(keys_of::<RawConfig>(), ["server", "sources", "consumers"]);
    }
}
