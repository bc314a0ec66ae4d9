//! The command line: the commands, their options and what each option accepts.

use crate::logs::LogFormat;
use clap::{Args, Parser, Subcommand};
use justonce_cli_support::{Usage, pacing};
use std::path::PathBuf;
use std::time::SystemTime;

/// Receives webhooks, stores each event once, answers 2xx fast, and delivers it once in
/// effect.
#[derive(Parser)]
#[command(name = "justonce", version)]
pub struct Cli {
    /// The configuration file, which may be absent: every setting can also come from a
    /// JUSTONCE_* variable (see `justonce config`). A file named by this option must exist.
    #[arg(
        long,
        global = true,
        env = "JUSTONCE_CONFIG",
        default_value = "justonce.toml"
    )]
    pub config: PathBuf,

    /// Refuse a JUSTONCE_* variable that names no setting, instead of warning about it.
    #[arg(long, global = true, env = "JUSTONCE_STRICT")]
    pub strict: bool,

    /// How log lines are written to stderr; `server.log_format` in the file, text by
    /// default.
    #[arg(long, global = true, env = "JUSTONCE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    #[command(flatten)]
    Configured(Box<Configured>),
    /// Print a completion script for a shell, such as
    /// `justonce completions bash > /etc/bash_completion.d/justonce`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// A command that runs with the configuration: every one but `completions`.
#[derive(Subcommand)]
pub enum Configured {
    /// Receive webhooks on the public listener and deliver them to their targets.
    Serve {
        /// Run only these roles, comma-separated: receiver, relay, consumers, purge (or
        /// all). Overrides server.roles. Processes on one database may each run any.
        #[arg(long, value_name = "ROLES")]
        role: Option<crate::config::Roles>,
    },
    /// Print the configuration the commands run with, as TOML, each value with where it
    /// came from: the file and line, a variable, DATABASE_URL or the default.
    ///
    /// Secrets show as their env:VARIABLE references, never their values, and the password
    /// of a URL as ***. Needs no database.
    Config,
    /// Create or update the database tables.
    Migrate {
        /// Print the SQL instead of running it, for a database administrator to apply.
        #[arg(long)]
        print_sql: bool,
        /// With --print-sql: only the migrations after this version (the highest in the
        /// `migrations` table of an existing database).
        #[arg(long, default_value_t = 0, requires = "print_sql")]
        since: i64,
    },
    /// Check the configuration and the database, resolve every target's host and connect to
    /// every consumer's broker, then exit; or, given a target or a job, check that it acts
    /// once per event however often the event arrives.
    ///
    /// The conformance kit sends generated events, each twice: a third of them both at once,
    /// a third one after the other, a third again after --between and --delay. Then it
    /// reads the effects in the target's database and reports each event that took effect
    /// not exactly once, and each try the target refused. Exit code 1 when any did.
    Check(CheckArgs),
    /// Delete keys past each source's retention, and sent deliveries past it too.
    Purge {
        /// Rows deleted per statement.
        #[arg(long, default_value_t = 1_000)]
        batch_size: u32,
        /// Before each statement, a pause this many times as long as the last one took, so
        /// that claims running meanwhile keep their speed; 0 purges flat out.
        #[arg(long, default_value_t = pacing::DEFAULT_RATIO, value_parser = pacing::pause_ratio)]
        pause: f64,
    },
    /// Show what the store holds: keys per consumer and scope, deliveries and stream offsets.
    ///
    /// Duplicates and key reuses are not stored: the running service counts them since it
    /// started, on the admin listener's /metrics.
    Stats {
        /// Print one JSON object, for scripts, instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Look after deliveries that were dead-lettered.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// See deliveries waiting for their target, and each delivery's attempts.
    Deliveries {
        #[command(subcommand)]
        command: DeliveriesCommand,
    },
    /// See the events each source and consumer stored, with their bodies and delivery
    /// attempts.
    Events {
        #[command(subcommand)]
        command: EventsCommand,
    },
    /// Deliver stored events again, with the same key: one by id, every one of a key, or
    /// every one of a source or consumer received in a time range.
    ///
    /// Events delivered or dead-lettered are put back to be delivered, their attempts
    /// counted anew; events still waiting for a delivery are left as they are. Without
    /// --yes, says what it would replay and changes nothing. A time range is refused while
    /// a replay of an overlapping range of the same source or consumer still runs.
    Replay(ReplayArgs),
    /// Inspect claimed keys; free or complete a lease whose worker is stuck.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Measure claims on the database: throughput beside a hand-written client, latency as
    /// the key table grows, a purge under load, and the webhook receiver under load.
    ///
    /// Runs in tables of its own, dropped at the end; prints a table, or one JSON object
    /// per result. Each throughput result checks that effect rows equal distinct keys.
    Bench(justonce_bench::Args),
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("subject").args(["target", "run"])))]
pub struct CheckArgs {
    /// The endpoint or broker to check: an http(s) URL, where each try is a POST with the
    /// event's key as `Idempotency-Key`; or an amqp, nats, redis, mqtt or kafka URL with --to,
    /// where each try is a message with the key as its id, published as the relay does.
    pub target: Option<String>,
    // The help of each option that takes `{n}` goes through `with_placeholders`.
    #[arg(long, conflicts_with = "target", help = with_placeholders(
        "The job to check instead of a target: a shell command run once per try, with \
         `{key}` and `{n}` replaced and the key in JUSTONCE_CHECK_KEY"
    ))]
    pub run: Option<String>,
    /// The queue (RabbitMQ), subject (NATS), stream (Redis) or topic (MQTT, Kafka) to publish
    /// to.
    #[arg(long, requires = "target")]
    pub to: Option<String>,
    /// A query listing the effects: one row per effect, its first column the event's key
    /// or number, such as `SELECT order_id FROM shipments`.
    #[arg(long, requires = "subject")]
    pub effects: Option<String>,
    /// A query counting the effects, read before and after, for effects that do not name
    /// their event; finds that some event failed, but not which.
    #[arg(long, requires = "subject", conflicts_with = "effects")]
    pub count: Option<String>,
    /// The database the effects are in; the configured one by default.
    #[arg(long, requires = "subject")]
    pub database: Option<String>,
    /// How many events to generate, keyed `check-<run>-<n>`.
    #[arg(long, default_value_t = 30, requires = "subject",
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub events: u64,
    /// The events' keys instead of generated ones, comma-separated, for a target that
    /// accepts only some.
    #[arg(
        long,
        value_delimiter = ',',
        requires = "subject",
        conflicts_with = "events"
    )]
    pub keys: Vec<String>,
    #[arg(
        long,
        requires = "subject",
        default_value = r#"{"id":"{key}","n":{n}}"#,
        help = with_placeholders(
            "The body of each try, with `{key}` and `{n}` (the event's number from 1) replaced"
        )
    )]
    pub body: String,
    #[arg(long = "header", requires = "subject", value_parser = header, help = with_placeholders(
        "A header sent with each HTTP try or message, as `Name: value`, with `{key}` and \
         `{n}` replaced; repeatable"
    ))]
    pub headers: Vec<(String, String)>,
    /// Sign HTTP tries the Standard Webhooks way with this secret (`whsec_...`), with the
    /// key as `webhook-id`, as a webhook source of `justonce serve` expects.
    #[arg(
        long,
        env = "JUSTONCE_CHECK_SECRET",
        hide_env_values = true,
        requires = "target"
    )]
    pub sign: Option<String>,
    /// A shell command run after the first tries and before the delayed ones, such as one
    /// that restarts the worker under test.
    #[arg(long, requires = "subject")]
    pub between: Option<String>,
    /// The pause before the delayed tries.
    #[arg(long, requires = "subject", default_value = "1s", value_parser = duration)]
    pub delay: std::time::Duration,
    /// How long the effects may take to appear once the tries are sent.
    #[arg(long, requires = "subject", default_value = "30s", value_parser = duration)]
    pub wait: std::time::Duration,
    /// Print one JSON object instead of the report.
    #[arg(long, requires = "subject")]
    pub json: bool,
}

/// What the conformance kit sends its events to: exactly one of a target and a job.
pub enum Subject {
    /// An endpoint's or a broker's URL.
    Target(String),
    /// A shell command run once per try.
    Job(String),
}

impl CheckArgs {
    /// What the conformance kit checks; none when `check` checks the configuration and the
    /// database instead.
    pub fn subject(&self) -> Result<Option<Subject>, Usage> {
        match (&self.target, &self.run) {
            (None, None) => Ok(None),
            (Some(url), None) => Ok(Some(Subject::Target(url.clone()))),
            (None, Some(command)) => Ok(Some(Subject::Job(command.clone()))),
            // clap refuses the two together before, in its own words.
            (Some(_), Some(_)) => Err(Usage(
                "--run checks a job instead of a target: give one of the two".to_owned(),
            )),
        }
    }
}

/// `text` as help that shows `{n}` as written. clap turns every `{n}` of a help text into a
/// line break; an escape code between its `{` and its `n`, which changes nothing on a
/// terminal and is left out elsewhere, keeps it whole.
fn with_placeholders(text: &str) -> clap::builder::StyledStr {
    let kept = format!("{{{}n}}", clap::builder::styling::Reset);
    text.replace("{n}", &kept).into()
}

/// `Name: value`.
fn header(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((name, value)) if !name.trim().is_empty() => {
            Ok((name.trim().to_owned(), value.trim().to_owned()))
        }
        _ => Err("expected `Name: value`".to_owned()),
    }
}

fn duration(text: &str) -> Result<std::time::Duration, String> {
    justonce_cli_support::parse_duration(text).map_err(|e| format!("{e:#}"))
}

/// How long ago a duration (`2h`) or an RFC 3339 time is.
fn ago(text: &str) -> Result<std::time::Duration, String> {
    justonce_cli_support::parse_ago(text, SystemTime::now()).map_err(|e| format!("{e:#}"))
}

/// A duration ago (`2h`) or an RFC 3339 time, as a time.
fn time(text: &str) -> Result<SystemTime, String> {
    justonce_cli_support::parse_time(text, SystemTime::now()).map_err(|e| format!("{e:#}"))
}

/// Whose events: a source's or a consumer's, by name.
#[derive(Args)]
#[group(multiple = false)]
pub struct OriginArgs {
    /// The events of this source (`[sources.NAME]`).
    #[arg(long)]
    pub source: Option<String>,
    /// The events of this consumer (`[consumers.NAME]`).
    #[arg(long)]
    pub consumer: Option<String>,
}

/// Which stored events a listing shows, and how.
#[derive(Args)]
pub struct EventListArgs {
    #[command(flatten)]
    pub origin: OriginArgs,
    /// Only the events whose key contains this anywhere, such as `1042`, matched as
    /// written: `%` and `_` are plain characters. No index serves it: without --since it
    /// searches the events received in the 24 hours before --until, or before now.
    #[arg(long)]
    pub key: Option<String>,
    /// Only the events whose key starts with this, such as `shop:evt_`: an index finds
    /// them.
    #[arg(long)]
    pub key_prefix: Option<String>,
    /// Only events received since this time: a duration ago, such as 2h, or an RFC 3339
    /// time, such as 2026-12-02T09:00:00Z.
    #[arg(long, value_parser = time)]
    pub since: Option<SystemTime>,
    /// Only events received until this time: a duration ago, such as 30m, or an RFC 3339
    /// time.
    #[arg(long, value_parser = time)]
    pub until: Option<SystemTime>,
    /// Only the events in this state.
    #[arg(long, value_parser = ["delivered", "due", "dead"])]
    pub state: Option<String>,
    /// At most this many, oldest first.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,
    /// Start after the last event of the previous page: the cursor it printed.
    #[arg(long)]
    pub cursor: Option<String>,
    /// Print one JSON object, for scripts, instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum EventsCommand {
    /// List stored events, oldest first, a page at a time, with their state: delivered,
    /// due (waiting for a delivery) or dead.
    List(EventListArgs),
    /// Show one event with its body, its headers and its last delivery attempts (up to
    /// 25).
    Show {
        /// The event's id.
        #[arg(required_unless_present = "key", conflicts_with = "key")]
        id: Option<i64>,
        /// Every event stored with this key (the Idempotency-Key its target receives).
        #[arg(long)]
        key: Option<String>,
        /// Print one JSON object (with --key, an array), for scripts.
        #[arg(long)]
        json: bool,
    },
}

/// What `replay` puts back: one event, a key's, or a source's or consumer's time range.
#[derive(Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["id", "key", "source", "consumer"])))]
pub struct ReplayArgs {
    /// The event's id.
    #[arg(conflicts_with_all = ["key", "source", "consumer", "since", "until"])]
    pub id: Option<i64>,
    /// Every event stored with this key.
    #[arg(long, conflicts_with_all = ["source", "consumer", "since", "until"])]
    pub key: Option<String>,
    #[command(flatten)]
    pub origin: OriginArgs,
    /// With --source or --consumer: the events received since this time, a duration ago
    /// such as 2h or an RFC 3339 time.
    #[arg(long, value_parser = time)]
    pub since: Option<SystemTime>,
    /// With --since: only the events received until this time; now by default.
    #[arg(long, value_parser = time, requires = "since")]
    pub until: Option<SystemTime>,
    /// Replay; without it, says what would be replayed and changes nothing.
    #[arg(long)]
    pub yes: bool,
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Show what the store holds for one key: done or in progress, and its fingerprint.
    Show {
        #[command(flatten)]
        key: KeyArgs,
    },
    /// Free a key whose lease is in progress (a stuck worker): the next claim takes it at once.
    ///
    /// It is the lease running out now: the worker can still finish until another claim
    /// takes the key. Asks for confirmation unless --yes. Fails, changing nothing, for a key
    /// that is not stored or is done.
    Release {
        #[command(flatten)]
        key: KeyArgs,
        /// Do not ask for confirmation; needed when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
    },
    /// Mark a key whose lease is in progress done by hand, with an optional result.
    ///
    /// For work known to be done: later claims find the key done, and its worker can no
    /// longer complete, renew or release it. Asks for confirmation unless --yes. Fails,
    /// changing nothing, for a key that is not stored or is done.
    Complete {
        #[command(flatten)]
        key: KeyArgs,
        /// The result to store, which later claims read; none by default.
        #[arg(long)]
        result: Option<String>,
        /// Do not ask for confirmation; needed when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
    },
}

/// Which key a `keys` command is about.
#[derive(Args)]
pub struct KeyArgs {
    /// The key, such as `shop:evt_1` for a webhook or an order id for a queue.
    pub key: String,
    /// The consumer that claimed it: a source's or consumer's name.
    #[arg(long)]
    pub consumer: String,
    /// The tenant scope, if the key was claimed in one.
    #[arg(long)]
    pub scope: Option<String>,
}

/// Which deliveries a listing shows, and how.
#[derive(Args)]
pub struct ListArgs {
    /// Only the deliveries to this destination: a target's or a consumer's name.
    #[arg(long)]
    pub destination: Option<String>,
    /// Only deliveries written (or last replayed) at most this long ago, such as 2h, or
    /// at or after an RFC 3339 time, such as 2026-12-02T09:00:00Z.
    #[arg(long, value_parser = ago)]
    pub since: Option<std::time::Duration>,
    /// Only deliveries written (or last replayed) at least this long ago, such as 30m, or
    /// at or before an RFC 3339 time.
    #[arg(long, value_parser = ago)]
    pub until: Option<std::time::Duration>,
    /// At most this many.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Print one JSON array, for scripts, instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum DeliveriesCommand {
    /// List deliveries waiting for their target, oldest first, with their attempts and
    /// last error: a first delivery not yet made, or a retry after a failure.
    List {
        /// The deliveries that are waiting (the only kind listed for now).
        #[arg(long, required = true)]
        due: bool,
        #[command(flatten)]
        filter: ListArgs,
    },
    /// Show one delivery with its state, its body and its last attempts (up to 25).
    Show {
        /// The delivery's id.
        #[arg(required_unless_present = "key", conflicts_with = "key")]
        id: Option<i64>,
        /// Every delivery written with this key (the Idempotency-Key the target receives).
        #[arg(long)]
        key: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first.
    List {
        #[command(flatten)]
        filter: ListArgs,
    },
    /// Show one delivery with its body and last error.
    Show {
        /// The delivery's id.
        id: i64,
    },
    /// Put dead letters back to be delivered again, with the same key.
    Replay {
        /// The delivery's id.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<i64>,
        /// Every dead letter.
        #[arg(long)]
        all: bool,
    },
    /// Delete every dead letter. Asks for confirmation unless --yes.
    Purge {
        /// Do not ask for confirmation; needed when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
    },
}
