//! `justonce check TARGET`: a conformance kit for a user's own endpoint, consumer or job.
//!
//! It sends generated events to the target, each twice (a third of them both at once, a
//! third one after the other, a third again after the command between tries and a delay),
//! then counts the effects in the user's database with the user's query and reports whether
//! each event took effect exactly once.

use crate::errors::opening_failed;
use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use justonce_cli_support::Usage;
use justonce_cli_support::database::DatabaseKind;
use justonce_http::HttpDestination;
use justonce_sql::sqlx::{
    self, AssertSqlSafe, Database, Decode, Executor, IntoArguments, MySql, Pool, Postgres, Row,
    Sqlite, Type,
};
use justonce_sql::{Backend, Delivered, Delivery, Destination};
use justonce_transport::amqp::AmqpDestination;
use justonce_transport::kafka::KafkaDestination;
use justonce_transport::mqtt::MqttDestination;
use justonce_transport::nats::NatsDestination;
use justonce_transport::redis_streams::RedisStreamDestination;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long the effects database may take to give a connection: `server.acquire_timeout`'s
/// default.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Tries sent at the same time, across events.
const IN_FLIGHT: usize = 8;
/// A try the target answered "not now" is sent again, as a retrying sender would, at most
/// this many times in all.
const ATTEMPTS: u32 = 5;
/// The effects are read this often while they settle.
const POLL: Duration = Duration::from_millis(200);
/// Once every event has an effect, the counts must hold still this long: a second effect
/// may come late.
const SETTLE: Duration = Duration::from_secs(1);

/// What receives the events.
pub enum Target {
    /// An HTTP endpoint or a broker, through the destination the relay uses for it: the
    /// event's key travels as `Idempotency-Key`, the message id, or `webhook-id` if signed.
    Destination {
        name: String,
        destination: Box<dyn Destination>,
    },
    /// A job: this shell command, with `{key}` and `{n}` replaced, is one try.
    Job(String),
}

impl Target {
    /// The target a URL names; `to` is the queue, subject, stream or topic of a broker.
    pub fn of(url: &str, to: Option<&str>, signing_secret: Option<&str>) -> Result<Self> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        let broker = |kind: &str| to.ok_or_else(|| usage(format!("a {kind} target needs --to")));
        let destination: Box<dyn Destination> = match scheme {
            "http" | "https" => {
                let mut http = HttpDestination::new(url).map_err(usage)?;
                if let Some(secret) = signing_secret {
                    http = http.signed_with(secret).map_err(usage)?;
                }
                Box::new(http)
            }
            "amqp" | "amqps" => Box::new(AmqpDestination::new(url, "", broker("RabbitMQ queue")?)),
            "nats" => Box::new(NatsDestination::new(url, broker("NATS subject")?)),
            "redis" | "rediss" => {
                Box::new(RedisStreamDestination::new(url, broker("Redis stream")?).map_err(usage)?)
            }
            "mqtt" | "mqtts" => {
                let client_id = format!("justonce-check-{}", std::process::id());
                Box::new(
                    MqttDestination::new(url, broker("MQTT topic")?, &client_id).map_err(usage)?,
                )
            }
            "kafka" => Box::new(KafkaDestination::new(url, broker("Kafka topic")?)),
            _ => {
                return Err(usage(format!(
                    "target {url:?}: expected an http(s), amqp, nats, redis, mqtt or kafka URL"
                )));
            }
        };
        if scheme.starts_with("http") && to.is_some() {
            return Err(usage(
                "--to names a broker's queue, subject, stream or topic",
            ));
        }
        Ok(Self::Destination {
            name: url.to_owned(),
            destination,
        })
    }
}

fn usage(error: impl std::fmt::Display) -> anyhow::Error {
    Usage(error.to_string()).into()
}

/// How the user's database shows the effects.
pub enum Effects {
    /// One row per effect, the first column naming its event by key or number.
    Rows(String),
    /// One number: all effects, counted before and after.
    Count(String),
}

pub struct Settings {
    pub target: Target,
    pub effects: Effects,
    /// The database the effects are in.
    pub database: String,
    /// The events' keys, in order; the event's number is its place from 1.
    pub keys: Vec<String>,
    /// The body of each try, with `{key}` and `{n}` replaced.
    pub body: String,
    pub headers: Vec<(String, String)>,
    /// A shell command run after the first tries and before the delayed second ones.
    pub between: Option<String>,
    pub delay: Duration,
    /// How long the effects may take to appear.
    pub wait: Duration,
    pub json: bool,
}

/// How an event's two tries are sent.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Timing {
    AtOnce,
    OneAfterOther,
    Delayed,
}

impl Timing {
    fn of(n: usize) -> Self {
        match n % 3 {
            1 => Self::AtOnce,
            2 => Self::OneAfterOther,
            _ => Self::Delayed,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::AtOnce => "at once",
            Self::OneAfterOther => "one after the other",
            Self::Delayed => "after a delay",
        }
    }
}

/// One event and what became of it.
struct Event {
    n: usize,
    key: String,
    timing: Timing,
    /// Each try's final answer: `Ok` if the target took it, else why not.
    answers: Vec<Result<(), String>>,
    effects: u64,
}

/// Runs the check and prints its report; fails when an event's effects are not exactly one.
pub async fn run(settings: Settings) -> Result<()> {
    let effects_db = EffectsDb::connect(&settings.database).await?;
    let mut events: Vec<Event> = settings
        .keys
        .iter()
        .enumerate()
        .map(|(index, key)| Event {
            n: index + 1,
            key: key.clone(),
            timing: Timing::of(index + 1),
            answers: Vec::new(),
            effects: 0,
        })
        .collect();

    // Effects already there would be counted as this run's: the check needs fresh events.
    // A count is taken before and after; effects per event must start at none.
    let counted_before = match &settings.effects {
        Effects::Count(sql) => Some(effects_db.total(sql).await?),
        Effects::Rows(sql) => {
            let values = effects_db.values(sql).await?;
            if let Some(problem) = effects_before(&values, &events) {
                return Err(usage(problem));
            }
            None
        }
    };

    let first: Vec<usize> = (0..events.len()).collect();
    let answers = send(&settings, &events, &first, true).await;
    record(&mut events, answers);
    if let Some(command) = &settings.between {
        let status = shell(command, &[]).await?;
        if !status.success() {
            bail!("the command between tries failed ({status}): {command}");
        }
    }
    tokio::time::sleep(settings.delay).await;
    let delayed: Vec<usize> = (0..events.len())
        .filter(|&index| events[index].timing == Timing::Delayed)
        .collect();
    let answers = send(&settings, &events, &delayed, false).await;
    record(&mut events, answers);

    let total = settle(&effects_db, &settings, &mut events, counted_before).await?;
    report(&settings, &events, total)
}

/// Sends the first tries (both, for the events sent at once or one after the other) or the
/// second tries of the delayed events, and returns each event's answers.
async fn send(
    settings: &Settings,
    events: &[Event],
    which: &[usize],
    first: bool,
) -> Vec<(usize, Vec<Result<(), String>>)> {
    futures_util::stream::iter(which.iter().copied())
        .map(|index| async move {
            let event = &events[index];
            let answers = match (first, event.timing) {
                (true, Timing::AtOnce) => {
                    let (one, two) =
                        tokio::join!(attempt(settings, event), attempt(settings, event));
                    vec![one, two]
                }
                (true, Timing::OneAfterOther) => {
                    let one = attempt(settings, event).await;
                    vec![one, attempt(settings, event).await]
                }
                _ => vec![attempt(settings, event).await],
            };
            (index, answers)
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await
}

fn record(events: &mut [Event], answers: Vec<(usize, Vec<Result<(), String>>)>) {
    for (index, mut answers) in answers {
        events[index].answers.append(&mut answers);
    }
}

/// One try, sent again while the target says "not now", as a retrying sender would.
async fn attempt(settings: &Settings, event: &Event) -> Result<(), String> {
    match &settings.target {
        Target::Job(command) => {
            let command = fill(command, event);
            let key = [("JUSTONCE_CHECK_KEY", event.key.as_str())];
            match shell(&command, &key).await {
                Ok(status) if status.success() => Ok(()),
                Ok(status) => Err(format!("the job exited with {status}")),
                Err(error) => Err(format!("{error:#}")),
            }
        }
        Target::Destination { destination, .. } => {
            let headers: Vec<(String, String)> = settings
                .headers
                .iter()
                .map(|(name, value)| (name.clone(), fill(value, event)))
                .collect();
            let body = fill(&settings.body, event);
            let (mut attempt, mut pause) = (1, Duration::from_millis(100));
            loop {
                let delivery = Delivery {
                    id: i64::try_from(event.n).unwrap_or(i64::MAX),
                    key: &event.key,
                    destination: "check",
                    payload: body.as_bytes(),
                    headers: &headers,
                    attempt,
                };
                match destination.deliver(delivery).await {
                    Delivered::Sent => return Ok(()),
                    Delivered::Reject { reason } => return Err(reason),
                    Delivered::Retry { reason, .. } if attempt == ATTEMPTS => return Err(reason),
                    Delivered::Retry { after, .. } => {
                        tokio::time::sleep(after.unwrap_or(pause).min(Duration::from_secs(5)))
                            .await;
                        (attempt, pause) = (attempt + 1, pause * 2);
                    }
                }
            }
        }
    }
}

/// `template` with the event's `{key}` and `{n}`.
fn fill(template: &str, event: &Event) -> String {
    template
        .replace("{key}", &event.key)
        .replace("{n}", &event.n.to_string())
}

async fn shell(command: &str, env: &[(&str, &str)]) -> Result<std::process::ExitStatus> {
    tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .envs(env.iter().copied())
        .kill_on_drop(true)
        .status()
        .await
        .with_context(|| format!("running {command}"))
}

/// Waits until every event shows an effect and the counts hold still, or the wait runs
/// out; sets each event's effects, and for a `Count` query, counted `before` the tries,
/// returns the counts before and after.
async fn settle(
    effects_db: &EffectsDb,
    settings: &Settings,
    events: &mut [Event],
    before: Option<u64>,
) -> Result<Option<(u64, u64)>> {
    let deadline = Instant::now() + settings.wait;
    let mut last = None;
    let mut still_since = Instant::now();
    loop {
        let now = effects_db.read(&settings.effects, events).await?;
        if last.as_ref() != Some(&now) {
            still_since = Instant::now();
        }
        let complete = match &now {
            Counted::PerEvent(counts) => counts.len() == events.len(),
            Counted::Total(after) => {
                after.saturating_sub(before.unwrap_or(0)) >= events.len() as u64
            }
        };
        let done = (complete && still_since.elapsed() >= SETTLE) || Instant::now() >= deadline;
        last = Some(now);
        if done {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    match last.expect("read at least once") {
        Counted::PerEvent(counts) => {
            for event in events.iter_mut() {
                event.effects = counts.get(&event.n).copied().unwrap_or(0);
            }
            Ok(None)
        }
        Counted::Total(after) => Ok(Some((before.unwrap_or(0), after))),
    }
}

fn report(settings: &Settings, events: &[Event], total: Option<(u64, u64)>) -> Result<()> {
    let answers = || events.iter().flat_map(|e| &e.answers);
    let tries = answers().count();
    let taken = answers().filter(|a| a.is_ok()).count();
    let refused: Vec<&Event> = events
        .iter()
        .filter(|e| e.answers.iter().any(Result::is_err))
        .collect();
    let lost: Vec<&Event> = events.iter().filter(|e| e.effects == 0).collect();
    let doubled: Vec<&Event> = events.iter().filter(|e| e.effects > 1).collect();
    let effects_ok = match total {
        Some((before, after)) => after.saturating_sub(before) == events.len() as u64,
        None => lost.is_empty() && doubled.is_empty(),
    };
    let passed = effects_ok && refused.is_empty();
    let target = match &settings.target {
        Target::Destination { name, .. } => name.clone(),
        Target::Job(command) => format!("job: {command}"),
    };

    if settings.json {
        let offending = |list: &[&Event]| {
            list.iter()
                .map(|e| serde_json::json!({"n": e.n, "key": e.key, "effects": e.effects}))
                .collect::<Vec<_>>()
        };
        let refusals: Vec<_> = refused
            .iter()
            .map(|e| {
                let reasons: Vec<_> = e.answers.iter().filter_map(|a| a.clone().err()).collect();
                serde_json::json!({"n": e.n, "key": e.key, "refused": reasons})
            })
            .collect();
        let mut object = serde_json::json!({
            "target": target,
            "events": events.len(),
            "tries": tries,
            "taken": taken,
            "refused": refusals,
            "passed": passed,
        });
        match total {
            Some((before, after)) => {
                object["effects"] = (after.saturating_sub(before)).into();
            }
            None => {
                object["effects"] = events.iter().map(|e| e.effects).sum::<u64>().into();
                object["lost"] = offending(&lost).into();
                object["duplicated"] = offending(&doubled).into();
            }
        }
        println!("{object}");
    } else {
        let count = |timing: Timing| events.iter().filter(|e| e.timing == timing).count();
        println!("target: {target}");
        println!(
            "events: {}, each sent twice ({} {}, {} {}, {} {})",
            events.len(),
            count(Timing::AtOnce),
            Timing::AtOnce.name(),
            count(Timing::OneAfterOther),
            Timing::OneAfterOther.name(),
            count(Timing::Delayed),
            Timing::Delayed.name(),
        );
        println!("tries taken: {taken} of {tries}");
        for event in &refused {
            for reason in event.answers.iter().filter_map(|a| a.as_ref().err()) {
                println!("  refused: event {} ({}): {reason}", event.n, event.key);
            }
        }
        match total {
            Some((before, after)) => println!(
                "effects: {} new for {} events (counted {before} before, {after} after)",
                after.saturating_sub(before),
                events.len()
            ),
            None => {
                println!(
                    "effects: {} events with one, {} with none, {} with more than one",
                    events.len() - lost.len() - doubled.len(),
                    lost.len(),
                    doubled.len()
                );
                for event in lost.iter().chain(&doubled) {
                    println!(
                        "  event {} ({}): {} effects, sent {}",
                        event.n,
                        event.key,
                        event.effects,
                        event.timing.name()
                    );
                }
            }
        }
    }
    if passed {
        if !settings.json {
            println!("passed: every event took effect once and every try was taken");
        }
        Ok(())
    } else if !effects_ok {
        bail!("failed: the effects are not one per event")
    } else {
        bail!("failed: the target refused tries")
    }
}

/// Why effects found before any try would be counted as this run's, if some are: a row
/// naming an event by its key, or by its number, which a run before this one also used.
fn effects_before(values: &[String], events: &[Event]) -> Option<String> {
    if let Some(event) = events.iter().find(|e| values.contains(&e.key)) {
        return Some(format!(
            "event {} ({}) already has effects before the check: delete them, or choose \
             --keys that no run has used",
            event.n, event.key
        ));
    }
    let number = values
        .iter()
        .find(|value| number_of(value, events).is_some())?;
    Some(format!(
        "the effects query already returns {number:?} before the check: its rows name events \
         by number, so rows an earlier run left count as this run's; delete them first, or \
         return each event's key"
    ))
}

/// The event a value of the effects query names by number, from 1.
fn number_of(value: &str, events: &[Event]) -> Option<usize> {
    value
        .parse()
        .ok()
        .filter(|n| (1..=events.len()).contains(n))
}

/// What the effects query counted.
#[derive(PartialEq, Eq, Debug)]
enum Counted {
    /// Effects per event number, for the events that have any.
    PerEvent(BTreeMap<usize, u64>),
    Total(u64),
}

/// The user's database, whichever it is.
enum EffectsDb {
    Postgres(Pool<Postgres>),
    MySql(Pool<MySql>),
    Sqlite(Pool<Sqlite>),
}

impl EffectsDb {
    /// Opens the user's database: a server with justonce's TLS rule (verified unless the URL
    /// says otherwise), a SQLite file as it is, its journal mode untouched.
    async fn connect(url: &str) -> Result<Self> {
        // A server that does not answer fails the check within seconds, as `serve` would.
        let kind = DatabaseKind::of(url)
            .map_err(|unknown| usage(format!("effects database {url:?}: {unknown}")))?;
        let opened = match kind {
            DatabaseKind::Postgres => {
                let pool = sqlx::pool::PoolOptions::new().acquire_timeout(CONNECT_TIMEOUT);
                // The check reads for seconds: it need not follow a failover, so the
                // watcher of a multi-host URL ends here.
                <Postgres as Backend>::connect(url, pool)
                    .await
                    .map(|(pool, _watcher)| Self::Postgres(pool))
            }
            DatabaseKind::MySql => {
                let pool = sqlx::pool::PoolOptions::new().acquire_timeout(CONNECT_TIMEOUT);
                <MySql as Backend>::connect(url, pool)
                    .await
                    .map(|(pool, _)| Self::MySql(pool))
            }
            DatabaseKind::Sqlite => Pool::connect(url)
                .await
                .map(Self::Sqlite)
                .map_err(|error| justonce_sql::Error::database(false, error)),
        };
        opened.map_err(|error| opening_failed(error, "the effects database", url))
    }

    /// The first column of each row `sql` returns.
    async fn values(&self, sql: &str) -> Result<Vec<String>> {
        match self {
            Self::Postgres(pool) => first_column(pool, sql).await,
            Self::MySql(pool) => first_column(pool, sql).await,
            Self::Sqlite(pool) => first_column(pool, sql).await,
        }
        .with_context(|| format!("the effects query {sql:?}"))
    }

    /// What the effects query counts now: in total, or per event.
    async fn read(&self, effects: &Effects, events: &[Event]) -> Result<Counted> {
        Ok(match effects {
            Effects::Count(sql) => Counted::Total(self.total(sql).await?),
            Effects::Rows(sql) => Counted::PerEvent(self.per_event(sql, events).await?),
        })
    }

    /// The one number the count query `sql` returns.
    async fn total(&self, sql: &str) -> Result<u64> {
        let values = self.values(sql).await?;
        let [value] = values.as_slice() else {
            bail!(
                "the count query must return one row; it returned {}",
                values.len()
            );
        };
        value
            .parse()
            .with_context(|| format!("the count query returned {value:?}, not a count"))
    }

    /// How many rows of the effects query `sql` name each event, by key or number, for the
    /// events that have any.
    async fn per_event(&self, sql: &str, events: &[Event]) -> Result<BTreeMap<usize, u64>> {
        let values = self.values(sql).await?;
        let by_name: BTreeMap<&str, usize> = events.iter().map(|e| (e.key.as_str(), e.n)).collect();
        let mut counts = BTreeMap::new();
        for value in &values {
            let n = by_name
                .get(value.as_str())
                .copied()
                .or_else(|| number_of(value, events));
            if let Some(n) = n {
                *counts.entry(n).or_default() += 1;
            }
        }
        Ok(counts)
    }
}

/// The first column of every row, as text: a string or an integer.
async fn first_column<DB>(pool: &Pool<DB>, sql: &str) -> Result<Vec<String>>
where
    DB: Database,
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> i32: Decode<'r, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let rows = sqlx::query(AssertSqlSafe(sql)).fetch_all(pool).await?;
    rows.iter()
        .map(|row| {
            row.try_get::<String, _>(0)
                .or_else(|_| row.try_get::<i64, _>(0).map(|v| v.to_string()))
                .or_else(|_| row.try_get::<i32, _>(0).map(|v| v.to_string()))
                .context("its first column is neither text nor an integer")
        })
        .collect()
}
