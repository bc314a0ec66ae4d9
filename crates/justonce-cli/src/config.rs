//! `justonce.toml` and the `JUSTONCE_*` variables that override it or stand in for it,
//! turned into validated settings before anything starts.

use anyhow::{Context, Result, anyhow, bail, ensure};
use justonce_cli_support::database::DatabaseKind;
use justonce_cli_support::parse_duration;
use justonce_http::HttpDestination;
use justonce_http::receiver::{IdLocation, Scheme, Source};
use justonce_sql::{Consumer, Retention};
use justonce_transport::KeyFrom;
use justonce_transport::amqp::AmqpOptions;
use justonce_transport::mqtt::MqttOptions;
use justonce_transport::nats::NatsOptions;
use justonce_transport::redis_streams::RedisStreamOptions;
use justonce_transport::tls::Tls;
use serde::Deserialize;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// Everything `serve` and the other commands need, checked. Not `Debug`: the database URL
/// may hold a password.
pub struct Settings {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub database: String,
    pub body_limit: usize,
    /// How long a delivery the relay took stays hidden from other relays.
    pub relay_lease: Duration,
    /// How often the service purges what is past its retention; `None`: never.
    pub purge_every: Option<Duration>,
    /// What each listener holds: timeouts and caps.
    pub limits: Limits,
    /// The most database connections the service opens.
    pub pool_size: u32,
    /// How long work waits for a database connection before it is refused.
    pub acquire_timeout: Duration,
    pub sources: Vec<SourceSettings>,
    pub consumers: Vec<ConsumerSettings>,
    /// How log lines are written, unless `--log-format` says otherwise.
    pub log_format: LogFormat,
    /// The URL `serve` posts its spans to over OTLP/HTTP; `None`: no traces are exported.
    pub traces_url: Option<String>,
    /// `JUSTONCE_*` variables that name no setting: a warning at start, an error with
    /// `--strict`.
    pub unknown_variables: Vec<String>,
    /// The effective configuration as TOML, each value with where it came from, secrets
    /// only by reference: what `justonce config` prints.
    pub printed: String,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human text, coloured on a terminal.
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

impl LogFormat {
    /// `text` or `json`.
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// What a listener holds before it closes or refuses a connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a connection may take to send a request's headers, counted from when it
    /// opened or its last answer was sent: it also closes idle keep-alive connections.
    pub header_timeout: Duration,
    /// How long one request may take, body included, before it is answered 408.
    pub request_timeout: Duration,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Requests in flight at once; one more is answered 503.
    pub max_requests: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 4_096,
            max_requests: 1_024,
        }
    }
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
    /// Whether the broker's certificate goes unchecked (`tls_verify = "insecure"`).
    pub tls_insecure: bool,
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
#[serde(
    deny_unknown_fields,
    expecting = "a table of server, sources and consumers"
)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    sources: BTreeMap<String, RawSource>,
    #[serde(default)]
    consumers: BTreeMap<String, RawConsumer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table of consumer settings")]
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
    timeout: Option<String>,
    deliver_for: Option<String>,
    target_secret: Option<String>,
    max_attempts: Option<Count>,
    prefetch: Option<Count>,
    tls_ca: Option<String>,
    tls_cert: Option<String>,
    tls_key: Option<String>,
    tls_verify: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a table of server settings")]
struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    database: Option<String>,
    body_limit: Option<String>,
    relay_lease: Option<String>,
    purge_every: Option<String>,
    header_timeout: Option<String>,
    request_timeout: Option<String>,
    max_connections: Option<Count>,
    max_requests: Option<Count>,
    pool_size: Option<Count>,
    acquire_timeout: Option<String>,
    log_format: Option<String>,
    otlp_endpoint: Option<String>,
}

/// A whole number written as a TOML integer or, from a variable, as text.
struct Count(u64);

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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table of source settings")]
struct RawSource {
    scheme: String,
    #[serde(default)]
    secrets: Vec<String>,
    tolerance: Option<String>,
    retry_horizon: Option<String>,
    retention: Option<String>,
    target: String,
    timeout: Option<String>,
    deliver_for: Option<String>,
    target_secret: Option<String>,
    id: Option<String>,
    signature_header: Option<String>,
}

/// The keys of a section, read from its struct's fields: adding a field is all it takes for
/// the file, its variable, `justonce config` and the unknown-variable check to know a key.
fn keys_of<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
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
fn named_sections() -> [(&'static str, &'static [&'static str]); 2] {
    [
        ("sources", keys_of::<RawSource>()),
        ("consumers", keys_of::<RawConsumer>()),
    ]
}

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
            None => read(None, &file, env),
        },
        Err(error) => Err(error).with_context(|| format!("reading {file}")),
    }
}

/// [`load`] for the text of the file named `file`; the fuzz target calls it without a file.
pub fn parse(text: &str, file: &str, env: &Env) -> Result<Settings> {
    read(Some(text), file, env)
}

/// [`load`] for the text of `file`, `None` when there is no such file.
fn read(text: Option<&str>, file: &str, env: &Env) -> Result<Settings> {
    let named = match text {
        Some(_) => file.to_owned(),
        None => format!("{file} (not found)"),
    };
    let found = text.is_some();
    let text = text.unwrap_or_default();
    // A syntax error shows its line and column.
    let mut document = DeTable::parse(text).with_context(|| format!("{file} is not valid TOML"))?;
    let applied = apply_env(document.get_mut(), env, text.len()).with_context(|| named.clone())?;
    let origin = Origin {
        file,
        found,
        text,
        document: document.get_ref().clone(),
        overrides: applied.overrides,
        defaults: RefCell::default(),
    };
    let raw = RawConfig::deserialize(toml::de::Deserializer::from(document))
        .map_err(|error| origin.explain(&error))
        .with_context(|| named.clone())?;
    let mut settings = validate(raw, env, &origin).with_context(|| named.clone())?;
    settings.unknown_variables = applied.unknown;
    settings.printed = origin.print();
    Ok(settings)
}

/// Where each setting came from: the parsed file, for its lines, the variables that set
/// settings or declared sources and consumers, and the defaults validation used.
struct Origin<'i> {
    file: &'i str,
    found: bool,
    text: &'i str,
    /// The file with the variables applied.
    document: DeTable<'i>,
    /// The variable that set each setting, or declared each source or consumer.
    overrides: BTreeMap<Vec<String>, String>,
    /// The defaults validation used, as TOML values, for `justonce config`.
    defaults: RefCell<BTreeMap<Vec<String>, String>>,
}

impl Origin<'_> {
    /// `sources.shop.retention (line 12)`, `... (from JUSTONCE_SOURCES_SHOP_RETENTION)`, or
    /// the bare key for a default. A source or consumer declared by variables takes its
    /// missing settings from variables too: those are named with theirs.
    fn name(&self, path: &[&str]) -> String {
        let key = path.join(".");
        let owned: Vec<String> = path.iter().map(|part| (*part).to_owned()).collect();
        if let Some(variable) = self.overrides.get(&owned) {
            return format!("{key} (from {variable})");
        }
        if let Some(span) = span_of(&self.document, &owned) {
            return format!("{key} (line {})", self.line(span.start));
        }
        if path.len() == 3 && self.overrides.contains_key(&owned[..2]) {
            return format!("{key} ({})", variable_of(path));
        }
        key
    }

    fn line(&self, offset: usize) -> usize {
        let offset = offset.min(self.text.len());
        self.text.as_bytes()[..offset]
            .iter()
            .filter(|byte| **byte == b'\n')
            .count()
            + 1
    }

    /// A deserialization error, named by the setting at its position.
    fn explain(&self, error: &toml::de::Error) -> anyhow::Error {
        let mut path = error
            .span()
            .map(|span| path_at(&self.document, span.start))
            .unwrap_or_default();
        let mut message = error.message().to_owned();
        // serde words a missing field `missing field `NAME``: name it by its own key.
        if let Some(field) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            path.push(field.to_owned());
            message = "is required".to_owned();
        }
        if path.is_empty() {
            return anyhow!("{message}");
        }
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        anyhow!("{}: {message}", self.name(&path))
    }

    /// `value`, or else `default`, which `justonce config` then shows as the value of `path`.
    fn or_default<'v>(&self, path: &[&str], value: Option<&'v str>, default: &'v str) -> &'v str {
        value.unwrap_or_else(|| {
            self.defaulted(path, quoted(default));
            default
        })
    }

    /// Records that `path` took its default, `value` as TOML.
    fn defaulted(&self, path: &[&str], value: String) {
        let path = path.iter().map(|part| (*part).to_owned()).collect();
        self.defaults.borrow_mut().insert(path, value);
    }

    /// The effective configuration as TOML: each setting that has a value, with where it
    /// came from as a comment. Secrets appear as their `env:` references, which validation
    /// requires, and a password in a URL as `***`.
    fn print(&self) -> String {
        let mut printed = format!(
            "# The configuration justonce runs with: {}{}, JUSTONCE_* variables and defaults.\n",
            self.file,
            if self.found { "" } else { " (not found)" }
        );
        self.print_table(&mut printed, &["server"], keys_of::<RawServer>());
        for (section, keys) in named_sections() {
            let Some(DeValue::Table(entries)) = self.document.get(section).map(Spanned::get_ref)
            else {
                continue;
            };
            for name in entries.keys() {
                self.print_table(&mut printed, &[section, name.get_ref()], keys);
            }
        }
        printed
    }

    fn print_table(&self, printed: &mut String, table: &[&str], keys: &[&str]) {
        let header: Vec<String> = table.iter().map(|part| bare_or_quoted(part)).collect();
        printed.push_str(&format!("\n[{}]\n", header.join(".")));
        for key in keys {
            let path: Vec<String> = table.iter().chain([key]).map(|p| (*p).to_owned()).collect();
            let (value, origin) = match value_at(&self.document, &path) {
                Some(value) => {
                    let origin = match self.overrides.get(&path) {
                        Some(variable) => format!("from {variable}"),
                        None => format!("{}, line {}", self.file, self.line(value.span().start)),
                    };
                    (toml_value(value.get_ref()), origin)
                }
                None => match self.defaults.borrow().get(&path) {
                    Some(default) => (default.clone(), "default".to_owned()),
                    None => continue,
                },
            };
            printed.push_str(&format!("{key} = {value}  # {origin}\n"));
        }
    }
}

/// The variable that sets `path`: `JUSTONCE_` and the path, upper case, `-` as `_`.
fn variable_of(path: &[&str]) -> String {
    format!("JUSTONCE_{}", path.join("_"))
        .to_uppercase()
        .replace('-', "_")
}

/// The value at `path`.
fn value_at<'d, 'i>(table: &'d DeTable<'i>, path: &[String]) -> Option<&'d Spanned<DeValue<'i>>> {
    let (first, rest) = path.split_first()?;
    let value = table.get(first.as_str())?;
    match (rest.is_empty(), value.get_ref()) {
        (true, _) => Some(value),
        (false, DeValue::Table(inner)) => value_at(inner, rest),
        (false, _) => None,
    }
}

/// The span of the value at `path`.
fn span_of(table: &DeTable<'_>, path: &[String]) -> Option<std::ops::Range<usize>> {
    value_at(table, path).map(Spanned::span)
}

/// The path of the innermost key whose key or value holds `offset`.
fn path_at(table: &DeTable<'_>, offset: usize) -> Vec<String> {
    for (key, value) in table {
        if let DeValue::Table(inner) = value.get_ref() {
            let inner_path = path_at(inner, offset);
            if !inner_path.is_empty() {
                return [vec![key.get_ref().to_string()], inner_path].concat();
            }
        }
        if key.span().contains(&offset) || value.span().contains(&offset) {
            return vec![key.get_ref().to_string()];
        }
    }
    Vec::new()
}

/// `value` as TOML, with URL passwords and secret query parameters as `***`.
fn toml_value(value: &DeValue<'_>) -> String {
    match value {
        DeValue::String(text) => quoted(&redacted(text)),
        DeValue::Integer(integer) => {
            let prefix = match integer.radix() {
                16 => "0x",
                8 => "0o",
                2 => "0b",
                _ => "",
            };
            format!("{prefix}{}", integer.as_str())
        }
        DeValue::Float(float) => float.as_str().to_owned(),
        DeValue::Boolean(boolean) => boolean.to_string(),
        DeValue::Datetime(datetime) => datetime.to_string(),
        DeValue::Array(items) => {
            let items: Vec<String> = items.iter().map(|i| toml_value(i.get_ref())).collect();
            format!("[{}]", items.join(", "))
        }
        DeValue::Table(table) => {
            let entries: Vec<String> = table
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{} = {}",
                        bare_or_quoted(k.get_ref()),
                        toml_value(v.get_ref())
                    )
                })
                .collect();
            format!("{{ {} }}", entries.join(", "))
        }
    }
}

/// A TOML basic string.
fn quoted(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\t' => quoted.push_str("\\t"),
            '\n' => quoted.push_str("\\n"),
            '\r' => quoted.push_str("\\r"),
            c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// A TOML key: bare when it can be.
fn bare_or_quoted(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare { key.to_owned() } else { quoted(key) }
}

/// `text` with the user information of a URL (the password, or a user that may be a
/// token) and any query parameter that names a password, secret or token as `***`.
pub fn redacted(text: &str) -> String {
    let mut redacted = text.to_owned();
    if let Some((scheme, rest)) = text.split_once("://") {
        let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
        if let Some(at) = authority.rfind('@') {
            let user = match authority[..at].split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_owned(),
            };
            redacted = format!("{scheme}://{user}@{}", &rest[at + 1..]);
        }
    }
    if let Some((base, query)) = redacted.split_once('?') {
        let query: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _))
                    if ["password", "secret", "token"]
                        .iter()
                        .any(|word| name.to_ascii_lowercase().contains(word)) =>
                {
                    format!("{name}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        redacted = format!("{base}?{}", query.join("&"));
    }
    redacted
}

/// What the variables did to the document.
struct Applied {
    /// The variable that set each setting, or declared each source or consumer.
    overrides: BTreeMap<Vec<String>, String>,
    /// `JUSTONCE_*` variables that name no setting.
    unknown: Vec<String>,
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

/// Applies the variables to the file's `document`.
///
/// `JUSTONCE_SERVER_<KEY>`, `JUSTONCE_SOURCES_<NAME>_<KEY>` and
/// `JUSTONCE_CONSUMERS_<NAME>_<KEY>` set a setting: the key is upper case; the longest key
/// that ends the variable wins, so `JUSTONCE_CONSUMERS_ORDERS_CLIENT_ID` is `client_id` of
/// `orders`. A name meets the file's source or consumer spelled the same way (upper case,
/// `-` as `_`); a name the file does not have declares a source or consumer, named in lower
/// case. `secrets` takes a comma-separated list. `DATABASE_URL` sets `server.database`, and
/// `OTEL_EXPORTER_OTLP_ENDPOINT` `server.otlp_endpoint`, when nothing else does.
///
/// Each value gets a span of its own past the end of the file's `len` bytes, so that an
/// error in it is traced back to its variable.
fn apply_env(document: &mut DeTable<'_>, env: &Env, len: usize) -> Result<Applied> {
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
        let value = if setting.key == "secrets" {
            let mut list = toml::de::DeArray::new();
            for secret in setting.value.split(',') {
                let secret = DeValue::String(secret.trim().to_owned().into());
                list.push(Spanned::new(span(), secret));
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

fn validate(raw: RawConfig, env: &Env, origin: &Origin<'_>) -> Result<Settings> {
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
    if let Err(unknown) = DatabaseKind::of(&database) {
        // The URL itself may hold a password: it is not repeated.
        bail!("{}: {unknown}", origin.name(&["server", "database"]));
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
    let acquire_timeout = positive(
        server.acquire_timeout.as_deref(),
        Duration::from_secs(2),
        "acquire_timeout",
    )?;
    let log_format = match server.log_format.as_deref() {
        None => LogFormat::default(),
        Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => bail!(
            "{}: {other:?} is not \"text\" or \"json\"",
            origin.name(&["server", "log_format"])
        ),
    };
    let traces_url = traces_url(server.otlp_endpoint.as_deref(), env, origin)?;
    // A delivery still running when its lease ends may be sent again by another relay,
    // with the same key: none starts after half the lease, and each gives up within the
    // other half, so that the two rarely overlap.
    let longest_timeout = relay_lease / 2;
    let sources = raw
        .sources
        .into_iter()
        .map(|(name, source)| validate_source(&name, source, longest_timeout, env, origin))
        .collect::<Result<Vec<_>>>()?;
    let consumers = raw
        .consumers
        .into_iter()
        .map(|(name, consumer)| validate_consumer(&name, consumer, longest_timeout, env, origin))
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
        purge_every,
        limits,
        pool_size,
        acquire_timeout,
        sources,
        consumers,
        log_format,
        traces_url,
        unknown_variables: Vec::new(),
        printed: String::new(),
    })
}

/// Where `serve` posts its spans: `<server.otlp_endpoint>/v1/traces` (the setting, which
/// `OTEL_EXPORTER_OTLP_ENDPOINT` sets when nothing else does), else the standard
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is; `None` when neither is set. A protocol
/// that a variable names must be `http/protobuf`: the only one this build speaks.
fn traces_url(setting: Option<&str>, env: &Env, origin: &Origin<'_>) -> Result<Option<String>> {
    let set = |name: &str| env.get(name).filter(|value| !value.trim().is_empty());
    let (url, named) = if let Some(base) = setting {
        let url = format!("{}/v1/traces", base.trim_end_matches('/'));
        (url, origin.name(&["server", "otlp_endpoint"]))
    } else if let Some(url) = set(OTLP_TRACES_ENDPOINT_VARIABLE) {
        (url.clone(), OTLP_TRACES_ENDPOINT_VARIABLE.to_owned())
    } else {
        return Ok(None);
    };
    if !cfg!(feature = "otlp") {
        // The standard variables may be meant for other programs: only the setting is
        // refused.
        let path = ["server".to_owned(), "otlp_endpoint".to_owned()];
        let by_standard_variable = origin
            .overrides
            .get(path.as_slice())
            .is_some_and(|variable| variable == OTLP_ENDPOINT_VARIABLE);
        ensure!(
            setting.is_none() || by_standard_variable,
            "{named}: this build of justonce exports no traces (built without the `otlp` feature)"
        );
        return Ok(None);
    }
    let parsed = reqwest::Url::parse(&url).ok();
    if !parsed.is_some_and(|url| matches!(url.scheme(), "http" | "https") && url.has_host()) {
        bail!("{named}: must be an http:// or https:// URL");
    }
    for variable in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(protocol) = set(variable) {
            ensure!(
                protocol.trim() == "http/protobuf",
                "{variable}: {protocol:?} is not supported: justonce exports traces over \
                 \"http/protobuf\""
            );
            break;
        }
    }
    Ok(Some(url))
}

/// The standard variable that sets `server.otlp_endpoint` when nothing else does.
const OTLP_ENDPOINT_VARIABLE: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The standard variable of the whole URL that traces go to.
const OTLP_TRACES_ENDPOINT_VARIABLE: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";

/// How long a delivery waits for its target's answer unless the target says otherwise.
const DEFAULT_TARGET_TIMEOUT: Duration = Duration::from_secs(10);

/// The signature schemes a source takes.
const SCHEMES: [&str; 5] = [
    "standard-webhooks",
    "stripe",
    "github",
    "hmac-sha256",
    "none",
];

/// The shortest signing secret a source takes.
const MIN_SECRET_BYTES: usize = 16;

/// The shortest `server.relay_lease`.
const MIN_RELAY_LEASE: Duration = Duration::from_secs(2);

fn validate_consumer(
    name: &str,
    raw: RawConsumer,
    longest_timeout: Duration,
    env: &Env,
    origin: &Origin<'_>,
) -> Result<ConsumerSettings> {
    let path = |key: &'static str| ["consumers", name, key];
    let at = |key: &'static str| origin.name(&path(key));
    let named = || origin.name(&["consumers", name]);
    Consumer::new(name).with_context(named)?;
    if name.contains(':') || name.contains('/') {
        bail!("{}: a consumer's name may not contain ':' or '/'", named());
    }
    let from = match raw.from.strip_prefix("env:") {
        Some(_) => resolve_secret(&raw.from, env).with_context(|| at("from"))?,
        None => raw.from.clone(),
    };
    let scheme = from.split_once("://").map_or("", |(scheme, _)| scheme);
    let (amqp, nats, redis, mqtt) = (
        matches!(scheme, "amqp" | "amqps"),
        scheme == "nats",
        matches!(scheme, "redis" | "rediss"),
        matches!(scheme, "mqtt" | "mqtts"),
    );
    if !(amqp || nats || redis || mqtt) {
        bail!(
            "{}: must be an amqp://, nats://, redis:// or mqtt:// URL (amqps://, rediss:// \
             and mqtts:// over TLS), or env:VARIABLE holding one: RabbitMQ, NATS JetStream, \
             Redis Streams and MQTT are the brokers this version consumes",
            at("from")
        );
    }
    let over_tls = nats || matches!(scheme, "amqps" | "rediss" | "mqtts");
    let tls = consumer_tls(&raw, over_tls, env, &at)?;
    let only = |present: bool, key: &'static str, broker: &str| -> Result<()> {
        if present {
            bail!("{}: only applies to {broker} consumers", at(key));
        }
        Ok(())
    };
    only(!amqp && raw.queue.is_some(), "queue", "RabbitMQ")?;
    only(
        !(amqp || nats) && raw.prefetch.is_some(),
        "prefetch",
        "RabbitMQ and NATS",
    )?;
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
    let key_from = match origin.or_default(&path("id"), raw.id.as_deref(), "message_id") {
        "message_id" => KeyFrom::MessageId,
        id => match id.split_once(':') {
            Some(("header", header)) if !header.is_empty() => KeyFrom::Header(header.to_owned()),
            Some(("json", pointer)) if pointer.starts_with('/') => {
                KeyFrom::Json(pointer.to_owned())
            }
            _ => bail!(
                "{}: {id:?} must be \"message_id\", \"header:NAME\" or \"json:/POINTER\"",
                at("id")
            ),
        },
    };
    let duration = |value: Option<&str>, default: &str, key: &'static str| {
        parse_duration(origin.or_default(&path(key), value, default)).with_context(|| at(key))
    };
    let retry_horizon = duration(raw.retry_horizon.as_deref(), "3d", "retry_horizon")?;
    let keep = duration(raw.retention.as_deref(), "7d", "retention")?;
    let retention = Retention::new(keep, retry_horizon).with_context(|| at("retention"))?;
    let deliver_for = duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
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
    // The defaults that are the consumer's own name.
    let or_name = |value: Option<&str>, key: &'static str| {
        origin.or_default(&path(key), value, name).to_owned()
    };
    let stream = || {
        raw.stream
            .clone()
            .filter(|s| !s.is_empty())
            .with_context(|| format!("{}: must name a stream", at("stream")))
    };
    let options = if nats {
        let stream = stream()?;
        let subject = origin.or_default(&path("subject"), raw.subject.as_deref(), &stream);
        let mut options = NatsOptions::new(&stream, subject)
            .key_from(key_from)
            .durable(or_name(raw.durable.as_deref(), "durable"));
        if let Some(attempts) = max_attempts {
            options = options.max_attempts(attempts);
        }
        if let Some(prefetch) = prefetch {
            options = options.prefetch(usize::from(prefetch));
        }
        BrokerOptions::Nats(with_tls(options, &tls, NatsOptions::tls))
    } else if redis {
        let group = or_name(raw.group.as_deref(), "group");
        let mut options = RedisStreamOptions::new(stream()?, group).key_from(key_from);
        if let Some(attempts) = max_attempts {
            options = options.max_attempts(attempts);
        }
        BrokerOptions::Redis(with_tls(options, &tls, RedisStreamOptions::tls))
    } else if mqtt {
        let topic = raw
            .topic
            .clone()
            .filter(|t| !t.is_empty())
            .with_context(|| format!("{}: must name a topic filter", at("topic")))?;
        let default_client_id = format!("justonce-{name}");
        let client_id = origin.or_default(
            &path("client_id"),
            raw.client_id.as_deref(),
            &default_client_id,
        );
        let mut options = MqttOptions::new(topic, client_id).key_from(key_from);
        if let Some(attempts) = max_attempts {
            options = options.max_attempts(attempts);
        }
        BrokerOptions::Mqtt(with_tls(options, &tls, MqttOptions::tls))
    } else {
        let queue = raw
            .queue
            .filter(|q| !q.is_empty())
            .with_context(|| format!("{}: must name a queue", at("queue")))?;
        let mut options = AmqpOptions::new(&queue).key_from(key_from);
        if let Some(attempts) = max_attempts {
            options = options.max_attempts(attempts);
        }
        if let Some(prefetch) = prefetch {
            options = options.prefetch(prefetch);
        }
        BrokerOptions::Amqp(with_tls(options, &tls, AmqpOptions::tls))
    };
    Ok(ConsumerSettings {
        name: name.to_owned(),
        from,
        options,
        tls_insecure: tls.as_ref().is_some_and(Tls::is_insecure),
        retention,
        destination: destination(
            &Target {
                url: &raw.target,
                secret: raw.target_secret.as_deref(),
                timeout: raw.timeout.as_deref(),
                longest_timeout,
            },
            env,
            origin,
            &path,
        )?,
        deliver_for,
    })
}

/// A consumer's TLS settings, with its files read and checked; `None` when it has none.
/// `takes_tls`: whether the URL connects over TLS (`amqps://`, `rediss://`, `mqtts://`) or
/// may (NATS, where the settings require TLS of the server).
fn consumer_tls(
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
fn with_tls<O>(options: O, tls: &Option<Tls>, set: fn(O, Tls) -> O) -> O {
    match tls {
        Some(tls) => set(options, tls.clone()),
        None => options,
    }
}

/// The target settings of a source or consumer, as written.
struct Target<'a> {
    url: &'a str,
    secret: Option<&'a str>,
    timeout: Option<&'a str>,
    /// Half the relay's lease: a delivery must end within it.
    longest_timeout: Duration,
}

/// The HTTP target of a source or consumer, signed when it has a secret, giving up on a
/// delivery after its `timeout` (10 s by default, or half the lease if shorter, so that a
/// target that never answers holds a delivery slot briefly). `path` gives the path of a
/// key of the source or consumer.
fn destination<'p>(
    target: &Target<'_>,
    env: &Env,
    origin: &Origin<'_>,
    path: &dyn Fn(&'static str) -> [&'p str; 3],
) -> Result<HttpDestination> {
    let at = |key| origin.name(&path(key));
    let timeout = match target.timeout {
        Some(timeout) => parse_duration(timeout).with_context(|| at("timeout"))?,
        None => {
            let timeout = DEFAULT_TARGET_TIMEOUT.min(target.longest_timeout);
            origin.defaulted(&path("timeout"), quoted(&duration_text(timeout)));
            timeout
        }
    };
    if timeout.is_zero() || timeout > target.longest_timeout {
        bail!(
            "{}: must be more than zero and at most half of server.relay_lease ({} ms)",
            at("timeout"),
            target.longest_timeout.as_millis()
        );
    }
    let mut destination = HttpDestination::with_timeout(target.url, timeout)
        .with_context(|| format!("{}: must be an http:// or https:// URL", at("target")))?;
    if let Some(reference) = target.secret {
        destination = resolve_secret(reference, env)
            .and_then(|secret| Ok(destination.signed_with(&secret)?))
            .with_context(|| at("target_secret"))?;
    }
    Ok(destination)
}

fn validate_source(
    name: &str,
    raw: RawSource,
    longest_timeout: Duration,
    env: &Env,
    origin: &Origin<'_>,
) -> Result<SourceSettings> {
    let path = |key: &'static str| ["sources", name, key];
    let at = |key: &'static str| origin.name(&path(key));
    let duration = |value: Option<&str>, default: &str, key: &'static str| {
        parse_duration(origin.or_default(&path(key), value, default)).with_context(|| at(key))
    };
    // First: what the other settings may be depends on the scheme, so a misspelt one must
    // not be reported as another setting's mistake.
    if !SCHEMES.contains(&raw.scheme.as_str()) {
        bail!(
            "{}: {:?} is not one of {}",
            at("scheme"),
            raw.scheme,
            SCHEMES.join(", ")
        );
    }
    let signs_a_timestamp = matches!(raw.scheme.as_str(), "standard-webhooks" | "stripe");
    if raw.tolerance.is_some() && !signs_a_timestamp {
        bail!(
            "{}: only applies to standard-webhooks and stripe, which sign a timestamp",
            at("tolerance")
        );
    }
    if raw.signature_header.is_some() && raw.scheme != "hmac-sha256" {
        bail!("{}: only applies to hmac-sha256", at("signature_header"));
    }
    // Only the schemes that sign a timestamp have a tolerance.
    let tolerance = if signs_a_timestamp {
        let tolerance = duration(raw.tolerance.as_deref(), "5m", "tolerance")?;
        if tolerance.is_zero() {
            bail!("{}: must be more than zero", at("tolerance"));
        }
        tolerance
    } else {
        Duration::ZERO
    };
    let retry_horizon = duration(raw.retry_horizon.as_deref(), "3d", "retry_horizon")?;
    let keep = duration(raw.retention.as_deref(), "7d", "retention")?;
    let retention = Retention::new(keep, retry_horizon).with_context(|| at("retention"))?;
    // A signed event sent again after its key was purged, still within the tolerance,
    // would be taken as new and act twice.
    if signs_a_timestamp && tolerance >= retention.keep() {
        bail!(
            "{}: must be shorter than retention ({}), or an event replayed after its key \
             was purged would act twice",
            at("tolerance"),
            raw.retention.as_deref().unwrap_or("7d")
        );
    }
    let deliver_for = duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
    let secrets = raw
        .secrets
        .iter()
        .map(|reference| resolve_secret(reference, env))
        .collect::<Result<Vec<_>>>()
        .with_context(|| at("secrets"))?;
    match (raw.scheme.as_str(), secrets.is_empty()) {
        ("none", false) => bail!("{}: scheme none takes no secrets", at("secrets")),
        ("none", true) => {}
        (scheme, true) => bail!(
            "{}: scheme {scheme} needs at least one secret",
            at("secrets")
        ),
        // A Standard Webhooks secret is checked once decoded, by its scheme.
        ("standard-webhooks", false) => {}
        _ => {
            if let Some(short) = secrets.iter().position(|s| s.len() < MIN_SECRET_BYTES) {
                bail!(
                    "{}: secret {} of the list is shorter than {MIN_SECRET_BYTES} bytes: \
                     a short secret can be guessed from one signed request",
                    at("secrets"),
                    short + 1
                );
            }
        }
    }
    let as_bytes = || {
        secrets
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect::<Vec<_>>()
    };
    let (scheme, default_id) = match raw.scheme.as_str() {
        "standard-webhooks" => (
            Scheme::standard_webhooks(&secrets, tolerance).with_context(|| at("secrets"))?,
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
            let header = origin.or_default(
                &path("signature_header"),
                raw.signature_header.as_deref(),
                "X-Signature",
            );
            axum::http::HeaderName::try_from(header).map_err(|_| {
                anyhow!(
                    "{}: {header:?} is not a header name",
                    at("signature_header")
                )
            })?;
            let scheme = Scheme::HmacSha256 {
                secrets: as_bytes(),
                header: header.to_ascii_lowercase(),
            };
            (scheme, None)
        }
        "none" => (Scheme::None, None),
        _ => unreachable!("the scheme was checked first"),
    };
    let id = match (raw.id.as_deref(), default_id) {
        (None, Some(default)) => Some(origin.or_default(&path("id"), None, default)),
        (id, _) => id,
    };
    let id = id.ok_or_else(|| {
        anyhow!(
            "{}: is required for scheme {}: \"header:NAME\" or \"json:/POINTER\"",
            at("id"),
            raw.scheme
        )
    })?;
    let id = match id.split_once(':') {
        Some(("header", header)) => IdLocation::Header(
            header
                .parse()
                .map_err(|_| anyhow!("{}: {header:?} is not a header name", at("id")))?,
        ),
        Some(("json", pointer)) if pointer.starts_with('/') => IdLocation::Json(pointer.to_owned()),
        _ => bail!(
            "{}: {id:?} must be \"header:NAME\" or \"json:/POINTER\"",
            at("id")
        ),
    };
    Ok(SourceSettings {
        name: name.to_owned(),
        source: Source::new(name, scheme, id).with_context(|| origin.name(&["sources", name]))?,
        retention,
        destination: destination(
            &Target {
                url: &raw.target,
                secret: raw.target_secret.as_deref(),
                timeout: raw.timeout.as_deref(),
                longest_timeout,
            },
            env,
            origin,
            &path,
        )?,
        deliver_for,
    })
}

/// Secrets are references to environment variables (`env:NAME`), so that the file holds
/// none and no log prints one.
fn resolve_secret(reference: &str, env: &Env) -> Result<String> {
    let Some(variable) = reference.strip_prefix("env:") else {
        bail!("secrets are written env:VARIABLE, not given in the file");
    };
    match env.get(variable) {
        Some(secret) if !secret.is_empty() => Ok(secret.clone()),
        Some(_) => bail!("the environment variable {variable} is empty"),
        None => bail!("the environment variable {variable} is not set"),
    }
}

/// `duration` as [`parse_duration`] reads it, in its largest whole unit.
fn duration_text(duration: Duration) -> String {
    let millis = duration.as_millis();
    let (per_unit, unit) = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ]
    .into_iter()
    .find(|(per_unit, _)| millis > 0 && millis.is_multiple_of(*per_unit))
    .unwrap_or((1, "ms"));
    format!("{}{unit}", millis / per_unit)
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

    fn env_of(pairs: &[(&str, &str)]) -> Env {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn load_text(text: &str, env: &Env) -> Result<Settings> {
        let path = write_temporary(text);
        let settings = load(&path, None, env);
        let _ = std::fs::remove_file(path);
        settings
    }

    fn error_of(text: &str, env: &Env) -> String {
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
        let example = include_str!("../../../examples/justonce.toml");
        let settings = load_text(example, &env).unwrap();
        let sources: Vec<&str> = settings.sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(sources, ["demo", "shop"]);
        assert_eq!(settings.relay_lease, Duration::from_secs(60));
        assert_eq!(settings.purge_every, Some(Duration::from_secs(3_600)));
    }

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

    /// `SHOP` and `ORDERS` together, the lines the cases below name:
    /// 3 `listen`, 4 `body_limit`, 7 `scheme`, 8 `secrets`, 9 `target`,
    /// 12 `from`, 13 `queue`, 15 `max_attempts`, 16 `target`.
    fn shop_and_orders() -> String {
        format!("{SHOP}{ORDERS}")
    }

    /// Loads `text` and checks that the error names the file, `key` and `expected`.
    fn assert_named(text: &str, env: &Env, key: &str, expected: &str) {
        let path = write_temporary(text);
        let error = match load(&path, None, env) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(error) => format!("{error:#}"),
        };
        let _ = std::fs::remove_file(&path);
        for part in [path.display().to_string().as_str(), key, expected] {
            assert!(error.contains(part), "{part:?} not in {error:?}");
        }
        for secret in ["c2VjcmV0", "hunter2"] {
            assert!(!error.contains(secret), "a secret was printed: {error}");
        }
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
                edit("env:ORDERS_BROKER", "kafka://127.0.0.1:9092"),
                "consumers.orders.from (line 12)",
                "amqp://, nats://, redis:// or mqtt://",
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
                "kafka://x",
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

    /// Standard Webhooks secrets and public keys mix in one list; an unusable one is named
    /// by its setting and position, never printed.
    #[test]
    fn standard_webhooks_takes_whsec_and_whpk_entries() {
        let both = SHOP.replace(
            "\"env:SHOP_SECRET\"",
            "\"env:SHOP_SECRET\", \"env:SHOP_KEY\"",
        );
        // The public key of RFC 8032's first test vector.
        let whpk = "whpk_11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=";
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0"), ("SHOP_KEY", whpk)]);
        load_text(&both, &env).unwrap();
        for (secret, key, expected) in [
            (
                "whsec_",
                "whpk_11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=",
                "secret 1 of 2: a Standard Webhooks secret is empty",
            ),
            (
                "whsec_c2VjcmV0",
                "whpk_c2VjcmV0",
                "secret 2 of 2: a Standard Webhooks public key must hold 32 bytes",
            ),
        ] {
            let env = env_of(&[("SHOP_SECRET", secret), ("SHOP_KEY", key)]);
            let error = error_of(&both, &env);
            assert!(error.contains("sources.shop.secrets (line 8)"), "{error}");
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
            assert!(!error.contains("c2VjcmV0"), "a secret was printed: {error}");
        }
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
        assert_eq!(
            parse_duration("36500d").unwrap(),
            Duration::from_secs(36_500 * 86_400)
        );
        assert!(parse_duration("36501d").is_err());
        assert!(parse_duration("18446744073709551615ms").is_err());
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("-1").is_err());
    }

    /// Loads with no file at all: every setting from `env` and defaults.
    fn load_without_file(env: &Env) -> Result<Settings> {
        load(
            &std::env::temp_dir().join("justonce-no-such-file.toml"),
            None,
            env,
        )
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
    fn traces_go_to_the_setting_else_to_the_standard_variables() {
        let traces = |text: &str, pairs: &[(&str, &str)]| {
            let env = env_of(&[&[("SHOP_SECRET", "whsec_c2VjcmV0")], pairs].concat());
            load_text(text, &env).unwrap().traces_url
        };
        assert_eq!(traces(SHOP, &[]), None);
        let general = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/");
        let signal = (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://collector:4318/traces",
        );
        let expected = |url: &str| Some(url.to_owned());
        assert_eq!(
            traces(SHOP, &[general]),
            expected("http://collector:4318/v1/traces")
        );
        assert_eq!(
            traces(SHOP, &[general, signal]),
            expected("http://collector:4318/traces")
        );
        let file = SHOP.replacen(
            "body_limit",
            "otlp_endpoint = \"https://traces.internal\"\nbody_limit",
            1,
        );
        assert_eq!(
            traces(&file, &[general, signal]),
            expected("https://traces.internal/v1/traces")
        );
        let variable = ("JUSTONCE_SERVER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        assert_eq!(
            traces(&file, &[variable]),
            expected("http://127.0.0.1:4318/v1/traces")
        );
        // An empty standard variable is as good as unset.
        assert_eq!(traces(SHOP, &[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]), None);

        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0"), general]);
        let printed = load_text(SHOP, &env).unwrap().printed;
        let line = "otlp_endpoint = \"http://collector:4318/\"  # from OTEL_EXPORTER_OTLP_ENDPOINT";
        assert!(printed.contains(line), "{printed}");
    }

    #[test]
    fn an_unusable_traces_endpoint_or_protocol_is_refused_by_name() {
        let secret = ("SHOP_SECRET", "whsec_c2VjcmV0");
        let general = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        let file = SHOP.replacen(
            "body_limit",
            "otlp_endpoint = \"collector:4318\"\nbody_limit",
            1,
        );
        assert_named(
            &file,
            &env_of(&[secret]),
            "server.otlp_endpoint (line 4)",
            "must be an http:// or https:// URL",
        );
        assert_named(
            SHOP,
            &env_of(&[secret, ("OTEL_EXPORTER_OTLP_ENDPOINT", "grpc://x:4317")]),
            "server.otlp_endpoint (from OTEL_EXPORTER_OTLP_ENDPOINT)",
            "must be an http:// or https:// URL",
        );
        for (variable, protocol) in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ] {
            assert_named(
                SHOP,
                &env_of(&[secret, general, (variable, protocol)]),
                variable,
                "is not supported: justonce exports traces over \"http/protobuf\"",
            );
        }
        // The signal's own protocol comes before the general one.
        let env = env_of(&[
            secret,
            general,
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]);
        assert!(load_text(SHOP, &env).unwrap().traces_url.is_some());
        // Without an endpoint nothing is exported, and the protocol does not matter.
        let env = env_of(&[secret, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]);
        assert_eq!(load_text(SHOP, &env).unwrap().traces_url, None);
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

    #[test]
    fn the_printed_configuration_shows_each_origin_and_no_secret() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
            (
                "DATABASE_URL",
                "postgres://app:hunter2@db.internal/app?sslmode=require&password=hunter2",
            ),
            ("JUSTONCE_SERVER_ADMIN_LISTEN", "127.0.0.1:19090"),
            ("JUSTONCE_SOURCES_SHOP_RETENTION", "10d"),
            (
                "JUSTONCE_CONSUMERS_AUDIT_FROM",
                "redis://:hunter2@127.0.0.1:6379",
            ),
            ("JUSTONCE_CONSUMERS_AUDIT_STREAM", "audit"),
            (
                "JUSTONCE_CONSUMERS_AUDIT_TARGET",
                "https://user:hunter2@example.com/a",
            ),
        ]);
        let path = write_temporary(&shop_and_orders());
        let file = path.display().to_string();
        let printed = load(&path, None, &env).unwrap().printed;
        let _ = std::fs::remove_file(&path);
        let expected = [
            "[server]".to_owned(),
            format!("listen = \"127.0.0.1:8080\"  # {file}, line 3"),
            "admin_listen = \"127.0.0.1:19090\"  # from JUSTONCE_SERVER_ADMIN_LISTEN".to_owned(),
            "database = \"postgres://app:***@db.internal/app?sslmode=require&password=***\"  \
             # from DATABASE_URL"
                .to_owned(),
            format!("body_limit = \"64KiB\"  # {file}, line 4"),
            "max_connections = 4096  # default".to_owned(),
            "header_timeout = \"10s\"  # default".to_owned(),
            "[sources.shop]".to_owned(),
            format!("secrets = [\"env:SHOP_SECRET\"]  # {file}, line 8"),
            "tolerance = \"5m\"  # default".to_owned(),
            "retention = \"10d\"  # from JUSTONCE_SOURCES_SHOP_RETENTION".to_owned(),
            "id = \"header:webhook-id\"  # default".to_owned(),
            "timeout = \"10s\"  # default".to_owned(),
            "[consumers.audit]".to_owned(),
            "from = \"redis://:***@127.0.0.1:6379\"  # from JUSTONCE_CONSUMERS_AUDIT_FROM"
                .to_owned(),
            "group = \"audit\"  # default".to_owned(),
            "target = \"https://user:***@example.com/a\"  # from JUSTONCE_CONSUMERS_AUDIT_TARGET"
                .to_owned(),
            "[consumers.orders]".to_owned(),
            format!("from = \"env:ORDERS_BROKER\"  # {file}, line 12"),
            format!("max_attempts = 3  # {file}, line 15"),
            "id = \"header:X-Order-Id\"".to_owned(),
        ];
        for line in &expected {
            assert!(
                printed.lines().any(|l| l.starts_with(line.as_str())),
                "{line:?} not in\n{printed}"
            );
        }
        for secret in ["c2VjcmV0", "hunter2"] {
            assert!(
                !printed.contains(secret),
                "a secret was printed:\n{printed}"
            );
        }
        // Keys that do not apply to a consumer's broker are not shown.
        let orders = printed.split("[consumers.orders]").nth(1).unwrap();
        assert!(
            !orders.contains("group =") && !orders.contains("stream ="),
            "{orders}"
        );

        // What is printed is a configuration the service takes, and prints the same.
        let secrets_only = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://127.0.0.1:5672/%2f"),
        ]);
        let again = load_text(&printed, &secrets_only).unwrap().printed;
        let values = |printed: &str| -> Vec<String> {
            printed
                .lines()
                .filter(|line| !line.starts_with('#'))
                .map(|line| line.split("  # ").next().unwrap().to_owned())
                .collect()
        };
        assert_eq!(values(&printed), values(&again));
    }

    #[test]
    fn urls_are_printed_without_their_passwords() {
        for (url, shown) in [
            ("postgres://u:pw@h:5432/db", "postgres://u:***@h:5432/db"),
            ("https://token@h/p?q=1", "https://***@h/p?q=1"),
            (
                "mysql://h/db?user=u&password=pw",
                "mysql://h/db?user=u&password=***",
            ),
            ("nats://h:4222?auth_token=t", "nats://h:4222?auth_token=***"),
            ("http://h/p@x", "http://h/p@x"),
            ("env:ORDERS_BROKER", "env:ORDERS_BROKER"),
        ] {
            assert_eq!(redacted(url), shown, "{url}");
        }
        assert_eq!(quoted("a\"b\\c\u{7f}"), "\"a\\\"b\\\\c\\u007F\"");
        assert_eq!(duration_text(Duration::from_millis(2_500)), "2500ms");
        assert_eq!(duration_text(Duration::from_secs(7_200)), "2h");
    }
}
