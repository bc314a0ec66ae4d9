//! The `JUSTONCE_*` variables, `DATABASE_URL` and the standard OpenTelemetry variables,
//! applied to the file's document as if written in it.

use super::document::value_at;
use super::raw::{RawServer, keys_of, named_sections};
use anyhow::{Result, bail};
use std::collections::BTreeMap;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// The variables the configuration reads: the process's, or a test's.
pub type Env = BTreeMap<String, String>;

/// The process's variables. One whose name or value is not UTF-8 is left out, as if unset.
pub fn process_env() -> Env {
    std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
        .collect()
}

/// `JUSTONCE_*` variables that are not settings: read by the command line, by fault tests,
/// or handed by `check` to the job it runs.
const OTHER_VARIABLES: [&str; 6] = [
    "JUSTONCE_CONFIG",
    "JUSTONCE_STRICT",
    "JUSTONCE_LOG_FORMAT",
    "JUSTONCE_FAILPOINT",
    "JUSTONCE_CHECK_SECRET",
    "JUSTONCE_CHECK_KEY",
];

/// The standard variable that sets `server.otlp_endpoint` when nothing else does.
pub const OTLP_ENDPOINT_VARIABLE: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The standard variable of the whole URL that traces go to.
pub const OTLP_TRACES_ENDPOINT_VARIABLE: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";

/// The variable that sets `path`: `JUSTONCE_` and the path, upper case, `-` as `_`.
pub fn variable_of(path: &[&str]) -> String {
    format!("JUSTONCE_{}", path.join("_"))
        .to_uppercase()
        .replace('-', "_")
}

/// What the variables did to the document.
pub struct Applied {
    /// The variable that set each setting, or declared each source or consumer.
    pub overrides: BTreeMap<Vec<String>, String>,
    /// `JUSTONCE_*` variables that name no setting.
    pub unknown: Vec<String>,
}

/// What one `JUSTONCE_*` variable names: its section, the name of its source or consumer
/// as the variable spells it, and its key.
struct Named<'v> {
    variable: &'v str,
    value: &'v str,
    section: &'static str,
    name: Option<&'v str>,
    key: &'static str,
    /// For a source or consumer: the other names the variable could be read as, with a
    /// shorter key (`ORDERS_CLIENT` with `id`, beside `ORDERS` with `client_id`).
    other_names: Vec<&'v str>,
}

/// The readings of `<NAME>_<KEY>` as a name and one of `keys`, the longest key first.
fn readings<'v>(rest: &'v str, keys: &[&'static str]) -> Vec<(&'v str, &'static str)> {
    let mut readings: Vec<(&str, &'static str)> = keys
        .iter()
        .filter_map(|key| {
            let name = rest.strip_suffix(key.to_uppercase().as_str())?;
            let name = name.strip_suffix('_').filter(|name| !name.is_empty())?;
            Some((name, *key))
        })
        .collect();
    readings.sort_by_key(|(_, key)| std::cmp::Reverse(key.len()));
    readings
}

/// How a name is spelled in variables: upper case, `-` as `_`.
fn spelled(name: &str) -> String {
    name.to_uppercase().replace('-', "_")
}

/// The keys whose variable holds a comma-separated list.
const LISTS: [&str; 2] = ["secrets", "tenants"];

/// The key whose variable holds `TENANT=env:VARIABLE` pairs, comma-separated; a tenant
/// named twice has two secrets.
const TENANT_SECRETS: &str = "tenant_secrets";

/// The table of each tenant's secrets that a `tenant_secrets` variable holds. A pair
/// without `=` becomes a tenant with an empty name, which validation refuses.
fn tenant_secrets(
    value: &str,
    span: &mut dyn FnMut() -> std::ops::Range<usize>,
) -> DeValue<'static> {
    let mut by_tenant: BTreeMap<String, toml::de::DeArray<'static>> = BTreeMap::new();
    for pair in value.split(',') {
        let (tenant, secret) = pair.split_once('=').unwrap_or(("", pair));
        let secret = DeValue::String(secret.trim().to_owned().into());
        by_tenant
            .entry(tenant.trim().to_owned())
            .or_default()
            .push(Spanned::new(span(), secret));
    }
    let mut table = DeTable::new();
    for (tenant, secrets) in by_tenant {
        table.insert(
            Spanned::new(span(), tenant.into()),
            Spanned::new(span(), DeValue::Array(secrets)),
        );
    }
    DeValue::Table(table)
}

/// Applies the variables to the file's `document`.
///
/// `JUSTONCE_SERVER_<KEY>`, `JUSTONCE_SOURCES_<NAME>_<KEY>` and
/// `JUSTONCE_CONSUMERS_<NAME>_<KEY>` set a setting: the key is upper case; the longest key
/// that ends the variable wins, so `JUSTONCE_CONSUMERS_ORDERS_CLIENT_ID` is `client_id` of
/// `orders`. A name meets the file's source or consumer spelled the same way (upper case,
/// `-` as `_`); a name the file does not have declares a source or consumer, named in lower
/// case. `secrets` and `tenants` take a comma-separated list, `tenant_secrets`
/// comma-separated `TENANT=env:VARIABLE` pairs. `DATABASE_URL` sets `server.database`, and
/// `OTEL_EXPORTER_OTLP_ENDPOINT` `server.otlp_endpoint`, when nothing else does.
///
/// Each value gets a span of its own past the end of the file's `len` bytes, so that an
/// error in it is traced back to its variable.
pub fn apply_env(document: &mut DeTable<'_>, env: &Env, len: usize) -> Result<Applied> {
    let mut unknown = Vec::new();
    let mut named = Vec::new();
    for (variable, value) in env.iter().filter(|(name, _)| name.starts_with("JUSTONCE_")) {
        match Named::of(variable, value) {
            Some(setting) => named.push(setting),
            None if OTHER_VARIABLES.contains(&variable.as_str()) => {}
            None => unknown.push(variable.clone()),
        }
    }
    let mut next_span = len;
    let mut span = move || {
        next_span += 1;
        next_span - 1..next_span
    };
    let mut overrides = BTreeMap::new();
    for setting in &named {
        let mut path = vec![setting.section.to_owned()];
        if let Some(name) = setting.name {
            path.push(entry_named(document, &named, setting, name)?);
        }
        path.push(setting.key.to_owned());
        let value = if setting.key == TENANT_SECRETS {
            tenant_secrets(setting.value, &mut span)
        } else if LISTS.contains(&setting.key) {
            let mut list = toml::de::DeArray::new();
            for item in setting.value.split(',') {
                let item = DeValue::String(item.trim().to_owned().into());
                list.push(Spanned::new(span(), item));
            }
            DeValue::Array(list)
        } else {
            DeValue::String(setting.value.to_owned().into())
        };
        if set(document, &path, value, &mut span) {
            overrides.insert(path[..2].to_vec(), setting.variable.to_owned());
        }
        overrides.insert(path, setting.variable.to_owned());
    }
    // The standard variables, each for the setting it stands for. The signal's own OTLP
    // endpoint comes before the general one, as the OpenTelemetry specification orders them.
    let set_here = |name: &str| env.get(name).filter(|value| !value.trim().is_empty());
    let otlp_endpoint = set_here(OTLP_ENDPOINT_VARIABLE)
        .filter(|_| set_here(OTLP_TRACES_ENDPOINT_VARIABLE).is_none());
    for (variable, url, key) in [
        ("DATABASE_URL", env.get("DATABASE_URL"), "database"),
        (OTLP_ENDPOINT_VARIABLE, otlp_endpoint, "otlp_endpoint"),
    ] {
        let path = ["server".to_owned(), key.to_owned()];
        if let Some(url) = url
            && value_at(document, &path).is_none()
        {
            set(
                document,
                &path,
                DeValue::String(url.clone().into()),
                &mut span,
            );
            overrides.insert(path.to_vec(), variable.to_owned());
        }
    }
    Ok(Applied { overrides, unknown })
}

/// The name in `document` of the source or consumer `setting` spells `name`: the file's
/// entry spelled the same in variables, or else `name` in lower case.
fn entry_named(
    document: &DeTable<'_>,
    named: &[Named<'_>],
    setting: &Named<'_>,
    name: &str,
) -> Result<String> {
    let section = setting.section;
    let in_file: Vec<String> = match document.get(section).map(Spanned::get_ref) {
        Some(DeValue::Table(entries)) => entries.keys().map(|k| k.get_ref().to_string()).collect(),
        _ => Vec::new(),
    };
    let declared = |wanted: &str| {
        let wanted = spelled(wanted);
        let by_variable = named.iter().any(|other| {
            other.section == section && other.name.is_some_and(|n| spelled(n) == wanted)
        });
        by_variable || in_file.iter().any(|n| spelled(n) == wanted)
    };
    if let Some(other) = setting.other_names.iter().find(|other| declared(other)) {
        bail!(
            "{}: could set {section}.{}.{} or a setting of {section}.{}: a variable is read \
             with the longest key it ends with, so set this one in the file",
            setting.variable,
            name.to_lowercase(),
            setting.key,
            other.to_lowercase()
        );
    }
    let matching: Vec<&String> = in_file
        .iter()
        .filter(|n| spelled(n) == spelled(name))
        .collect();
    match matching.as_slice() {
        [] => Ok(name.to_lowercase()),
        [one] => Ok((*one).clone()),
        [one, two, ..] => bail!(
            "{}: names both {section}.{one} and {section}.{two}, which are spelled the same \
             in variables (upper case, '-' as '_'): rename one",
            setting.variable
        ),
    }
}

/// Sets the value at `path`, making the tables on the way with spans from `span`. Returns
/// whether it made the table of a source or consumer, which the variable then declares.
fn set<'i>(
    document: &mut DeTable<'i>,
    path: &[String],
    value: DeValue<'i>,
    span: &mut dyn FnMut() -> std::ops::Range<usize>,
) -> bool {
    let (key, tables) = path.split_last().expect("a path names a key");
    let mut table = document;
    let mut declared = false;
    for (depth, part) in tables.iter().enumerate() {
        let mut made = false;
        let entry = table
            .entry(Spanned::new(span(), part.clone().into()))
            .or_insert_with(|| {
                made = true;
                Spanned::new(span(), DeValue::Table(DeTable::new()))
            });
        declared |= made && depth == 1;
        // Not a table in the file: deserializing the file reports it.
        let DeValue::Table(inner) = entry.get_mut() else {
            return false;
        };
        table = inner;
    }
    let span = span();
    table.insert(
        Spanned::new(span.clone(), key.clone().into()),
        Spanned::new(span, value),
    );
    declared
}

impl<'v> Named<'v> {
    /// What `variable` names, read with the longest key; `None` for a variable that names
    /// no setting.
    fn of(variable: &'v str, value: &'v str) -> Option<Self> {
        let rest = variable.strip_prefix("JUSTONCE_")?;
        let named = |section, name, key, other_names| Named {
            variable,
            value,
            section,
            name,
            key,
            other_names,
        };
        if let Some(key) = rest.strip_prefix("SERVER_") {
            let key = keys_of::<RawServer>()
                .iter()
                .find(|known| known.to_uppercase() == key)?;
            return Some(named("server", None, key, Vec::new()));
        }
        named_sections().into_iter().find_map(|(section, keys)| {
            let rest = rest.strip_prefix(&format!("{}_", section.to_uppercase()))?;
            let readings = readings(rest, keys);
            let (&(name, key), others) = readings.split_first()?;
            let other_names = others.iter().map(|(name, _)| *name).collect();
            Some(named(section, Some(name), key, other_names))
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{
        SHOP, assert_named, env_of, load_text, load_without_file, shop_and_orders,
    };
    use std::time::Duration;

    #[test]
    fn a_bad_override_names_its_variable() {
        for (variable, value, key, expected) in [
            (
                "JUSTONCE_SOURCES_SHOP_RETENTION",
                "5",
                "sources.shop.retention (from JUSTONCE_SOURCES_SHOP_RETENTION)",
                "needs a unit",
            ),
            (
                "JUSTONCE_SERVER_LISTEN",
                "nowhere",
                "server.listen (from JUSTONCE_SERVER_LISTEN)",
                "an address such as",
            ),
            (
                "JUSTONCE_CONSUMERS_ORDERS_FROM",
                "pulsar://x",
                "consumers.orders.from (from JUSTONCE_CONSUMERS_ORDERS_FROM)",
                "amqp://",
            ),
        ] {
            let env = env_of(&[
                ("SHOP_SECRET", "whsec_c2VjcmV0"),
                ("ORDERS_BROKER", "amqp://127.0.0.1:5672/%2f"),
                (variable, value),
            ]);
            assert_named(&shop_and_orders(), &env, key, expected);
        }
    }

    #[test]
    fn sources_and_consumers_are_declared_by_variables_alone() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_LISTEN", "127.0.0.1:18080"),
            ("JUSTONCE_SOURCES_SHOP_SCHEME", "standard-webhooks"),
            ("JUSTONCE_SOURCES_SHOP_SECRETS", "env:SHOP_SECRET"),
            ("JUSTONCE_SOURCES_SHOP_TARGET", "http://127.0.0.1:9000/shop"),
            (
                "JUSTONCE_CONSUMERS_ORDER_EVENTS_FROM",
                "amqp://127.0.0.1:5672/%2f",
            ),
            ("JUSTONCE_CONSUMERS_ORDER_EVENTS_QUEUE", "orders"),
            (
                "JUSTONCE_CONSUMERS_ORDER_EVENTS_TARGET",
                "http://127.0.0.1:9000/o",
            ),
            ("JUSTONCE_CONSUMERS_ORDER_EVENTS_MAX_ATTEMPTS", "3"),
            ("JUSTONCE_CONSUMERS_ORDER_EVENTS_PREFETCH", "20"),
            ("JUSTONCE_CONSUMERS_ORDER_EVENTS_RETENTION", "10d"),
        ]);
        let settings = load_without_file(&env).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:18080".parse().unwrap());
        let sources: Vec<&str> = settings.sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(sources, ["shop"]);
        let [orders] = settings.consumers.as_slice() else {
            panic!("one consumer");
        };
        assert_eq!(orders.name, "order_events");
        assert_eq!(orders.retention.keep(), Duration::from_secs(10 * 86_400));
        let options = format!("{:?}", orders.options);
        for part in ["max_attempts: 3", "prefetch: 20", "\"orders\""] {
            assert!(options.contains(part), "{part} not in {options}");
        }
        assert!(settings.unknown_variables.is_empty());
    }

    /// A variable meets the file's source spelled the same way, `-` as `_`; two of the
    /// file's names spelled the same are refused once a variable names them.
    #[test]
    fn a_variable_meets_the_file_entry_spelled_the_same() {
        let partial = "[sources.Order-Hooks]\nscheme = \"standard-webhooks\"\n\
                       secrets = [\"env:SHOP_SECRET\"]\n";
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            (
                "JUSTONCE_SOURCES_ORDER_HOOKS_TARGET",
                "http://127.0.0.1:9000/o",
            ),
        ]);
        let settings = load_text(partial, &env).unwrap();
        let names: Vec<&str> = settings.sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["Order-Hooks"]);
        let twins = format!(
            "{partial}target = \"http://127.0.0.1:9000/o\"\n\n[sources.order_hooks]\n\
             scheme = \"none\"\nid = \"json:/id\"\ntarget = \"http://127.0.0.1:9000/o\"\n"
        );
        load_text(&twins, &env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")])).unwrap();
        assert_named(
            &twins,
            &env,
            "JUSTONCE_SOURCES_ORDER_HOOKS_TARGET: names both sources.Order-Hooks and \
             sources.order_hooks",
            "rename one",
        );
    }

    /// `JUSTONCE_CONSUMERS_ORDERS_CLIENT_ID` is `client_id` of `orders`, the longest key;
    /// when a consumer `orders_client` exists too, it is refused as ambiguous.
    #[test]
    fn the_longest_key_wins_and_an_ambiguous_variable_is_refused() {
        let orders = "[consumers.orders]\nfrom = \"mqtt://127.0.0.1:1883\"\ntopic = \"o/#\"\n\
                      target = \"http://127.0.0.1:9000/o\"\n";
        let env = env_of(&[("JUSTONCE_CONSUMERS_ORDERS_CLIENT_ID", "edge-1")]);
        let settings = load_text(orders, &env).unwrap();
        let options = format!("{:?}", settings.consumers[0].options);
        assert!(options.contains("\"edge-1\""), "{options}");
        let both = format!("{orders}\n{}", orders.replace("orders]", "orders_client]"));
        assert_named(
            &both,
            &env,
            "JUSTONCE_CONSUMERS_ORDERS_CLIENT_ID: could set consumers.orders.client_id or a \
             setting of consumers.orders_client",
            "set this one in the file",
        );
    }

    #[test]
    fn a_declared_entry_is_checked_as_the_file_is_naming_its_variables() {
        let source = [
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SOURCES_SHOP_SCHEME", "standard-webhooks"),
            ("JUSTONCE_SOURCES_SHOP_SECRETS", "env:SHOP_SECRET"),
        ];
        let consumer = [
            (
                "JUSTONCE_CONSUMERS_ORDERS_FROM",
                "amqp://guest:hunter2@127.0.0.1/%2f",
            ),
            ("JUSTONCE_CONSUMERS_ORDERS_QUEUE", "orders"),
            (
                "JUSTONCE_CONSUMERS_ORDERS_TARGET",
                "http://127.0.0.1:9000/o",
            ),
        ];
        let with = |extra: &[(&str, &str)]| env_of(&[&source[..], &consumer[..], extra].concat());
        let cases = [
            (
                with(&[]),
                "sources.shop.target (JUSTONCE_SOURCES_SHOP_TARGET)",
                "is required",
            ),
            (
                with(&[
                    ("JUSTONCE_SOURCES_SHOP_TARGET", "http://127.0.0.1:9000/s"),
                    ("JUSTONCE_CONSUMERS_ORDERS_PREFETCH", "many"),
                ]),
                "consumers.orders.prefetch (from JUSTONCE_CONSUMERS_ORDERS_PREFETCH)",
                "\"many\" is not a whole number",
            ),
            (
                with(&[
                    ("JUSTONCE_SOURCES_SHOP_TARGET", "http://127.0.0.1:9000/s"),
                    ("JUSTONCE_CONSUMERS_ORDERS_STREAM", "s"),
                ]),
                "consumers.orders.stream (from JUSTONCE_CONSUMERS_ORDERS_STREAM)",
                "only applies to NATS and Redis Streams",
            ),
            (
                with(&[
                    ("JUSTONCE_SOURCES_SHOP_TARGET", "http://127.0.0.1:9000/s"),
                    ("JUSTONCE_CONSUMERS_SHOP_FROM", "amqp://127.0.0.1/%2f"),
                    ("JUSTONCE_CONSUMERS_SHOP_QUEUE", "shop"),
                    ("JUSTONCE_CONSUMERS_SHOP_TARGET", "http://127.0.0.1:9000/c"),
                ]),
                "consumers.shop (from JUSTONCE_CONSUMERS_SHOP_FROM)",
                "names both a source and a consumer",
            ),
        ];
        for (env, key, expected) in cases {
            let error = format!("{:#}", load_without_file(&env).err().expect("refused"));
            for part in ["justonce-no-such-file.toml (not found)", key, expected] {
                assert!(error.contains(part), "{part:?} not in {error:?}");
            }
            assert!(
                !error.contains("hunter2"),
                "a password was printed: {error}"
            );
        }
    }

    #[test]
    fn database_url_is_used_unless_the_setting_is_given() {
        let url = "postgres://app:hunter2@db.internal/app";
        let env = env_of(&[("DATABASE_URL", url)]);
        assert_eq!(load_without_file(&env).unwrap().database, url);
        let both = env_of(&[
            ("DATABASE_URL", url),
            ("JUSTONCE_SERVER_DATABASE", "sqlite://mine.db"),
        ]);
        assert_eq!(
            load_without_file(&both).unwrap().database,
            "sqlite://mine.db"
        );
        let file = "[server]\ndatabase = \"mysql://127.0.0.1/app\"\n";
        assert_eq!(
            load_text(file, &env).unwrap().database,
            "mysql://127.0.0.1/app"
        );
        let bad = env_of(&[("DATABASE_URL", "mongodb://app:hunter2@x")]);
        assert_named(
            "",
            &bad,
            "server.database (from DATABASE_URL)",
            "must be a sqlite://, postgres:// or mysql:// URL",
        );
    }

    #[test]
    fn variables_that_name_no_setting_are_reported() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SERVER_LISTN", "127.0.0.1:1"),
            ("JUSTONCE_SOURCES_SHOP_RETENTON", "9d"),
            ("JUSTONCE_SOURCES__TARGET", "http://127.0.0.1:1/"),
            ("JUSTONCE_SERVER_listen", "127.0.0.1:1"),
            ("JUSTONCE_CONFIG", "justonce.toml"),
            ("JUSTONCE_LOG_FORMAT", "json"),
            ("JUSTONCE_FAILPOINT", "stored-not-answered"),
            ("JUSTONCE_STRICT", "true"),
            ("JUSTONCE_CHECK_SECRET", "whsec_c2VjcmV0"),
        ]);
        let settings = load_text(SHOP, &env).unwrap();
        assert_eq!(
            settings.unknown_variables,
            [
                "JUSTONCE_SERVER_LISTN",
                "JUSTONCE_SERVER_listen",
                "JUSTONCE_SOURCES_SHOP_RETENTON",
                "JUSTONCE_SOURCES__TARGET",
            ]
        );
        assert_eq!(settings.listen, "127.0.0.1:8080".parse().unwrap());
    }
}
