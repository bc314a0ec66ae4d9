//! `justonce`: the service that receives webhooks, stores each event once, answers 2xx and
//! delivers it with its own key; and the commands that look after its database.
//!
//! Exit codes: 0 on success, 2 on bad usage or configuration, 1 on failure.

mod activity;
mod check;
mod commands;
mod config;
mod errors;
mod listener;
mod logs;
mod probes;
mod purge;
mod serve;
#[cfg(feature = "otlp")]
mod traces;

use clap::parser::ValueSource;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use justonce_cli_support::pacing;
use std::path::PathBuf;
use std::process::ExitCode;

/// Receives webhooks, stores each event once, answers 2xx fast, and delivers it once in
/// effect.
#[derive(Parser)]
#[command(name = "justonce", version)]
struct Cli {
    /// The configuration file, which may be absent: every setting can also come from a
    /// JUSTONCE_* variable (see `justonce config`). A file named by this option must exist.
    #[arg(
        long,
        global = true,
        env = "JUSTONCE_CONFIG",
        default_value = "justonce.toml"
    )]
    config: PathBuf,

    /// Refuse a JUSTONCE_* variable that names no setting, instead of warning about it.
    #[arg(long, global = true, env = "JUSTONCE_STRICT")]
    strict: bool,

    /// How log lines are written to stderr; `server.log_format` in the file, text by
    /// default.
    #[arg(long, global = true, env = "JUSTONCE_LOG_FORMAT", value_enum)]
    log_format: Option<logs::LogFormat>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Receive webhooks on the public listener and deliver them to their targets.
    Serve,
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
    /// Print a completion script for a shell, such as
    /// `justonce completions bash > /etc/bash_completion.d/justonce`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("subject").args(["target", "run"])))]
struct CheckArgs {
    /// The endpoint or broker to check: an http(s) URL, where each try is a POST with the
    /// event's key as `Idempotency-Key`; or an amqp, nats, redis or mqtt URL with --to,
    /// where each try is a message with the key as its id, published as the relay does.
    target: Option<String>,
    // The help of each option that takes `{n}` goes through `with_placeholders`.
    #[arg(long, conflicts_with = "target", help = with_placeholders(
        "The job to check instead of a target: a shell command run once per try, with \
         `{key}` and `{n}` replaced and the key in JUSTONCE_CHECK_KEY"
    ))]
    run: Option<String>,
    /// The queue (RabbitMQ), subject (NATS), stream (Redis) or topic (MQTT) to publish to.
    #[arg(long, requires = "target")]
    to: Option<String>,
    /// A query listing the effects: one row per effect, its first column the event's key
    /// or number, such as `SELECT order_id FROM shipments`.
    #[arg(long, requires = "subject")]
    effects: Option<String>,
    /// A query counting the effects, read before and after, for effects that do not name
    /// their event; finds that some event failed, but not which.
    #[arg(long, requires = "subject", conflicts_with = "effects")]
    count: Option<String>,
    /// The database the effects are in; the configured one by default.
    #[arg(long, requires = "subject")]
    database: Option<String>,
    /// How many events to generate, keyed `check-<run>-<n>`.
    #[arg(long, default_value_t = 30, requires = "subject",
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    events: u64,
    /// The events' keys instead of generated ones, comma-separated, for a target that
    /// accepts only some.
    #[arg(
        long,
        value_delimiter = ',',
        requires = "subject",
        conflicts_with = "events"
    )]
    keys: Vec<String>,
    #[arg(
        long,
        requires = "subject",
        default_value = r#"{"id":"{key}","n":{n}}"#,
        help = with_placeholders(
            "The body of each try, with `{key}` and `{n}` (the event's number from 1) replaced"
        )
    )]
    body: String,
    #[arg(long = "header", requires = "subject", value_parser = header, help = with_placeholders(
        "A header sent with each HTTP try or message, as `Name: value`, with `{key}` and \
         `{n}` replaced; repeatable"
    ))]
    headers: Vec<(String, String)>,
    /// Sign HTTP tries the Standard Webhooks way with this secret (`whsec_...`), with the
    /// key as `webhook-id`, as a webhook source of `justonce serve` expects.
    #[arg(
        long,
        env = "JUSTONCE_CHECK_SECRET",
        hide_env_values = true,
        requires = "target"
    )]
    sign: Option<String>,
    /// A shell command run after the first tries and before the delayed ones, such as one
    /// that restarts the worker under test.
    #[arg(long, requires = "subject")]
    between: Option<String>,
    /// The pause before the delayed tries.
    #[arg(long, requires = "subject", default_value = "1s", value_parser = duration)]
    delay: std::time::Duration,
    /// How long the effects may take to appear once the tries are sent.
    #[arg(long, requires = "subject", default_value = "30s", value_parser = duration)]
    wait: std::time::Duration,
    /// Print one JSON object instead of the report.
    #[arg(long, requires = "subject")]
    json: bool,
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

#[derive(Subcommand)]
enum KeysCommand {
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
struct KeyArgs {
    /// The key, such as `shop:evt_1` for a webhook or an order id for a queue.
    key: String,
    /// The consumer that claimed it: a source's or consumer's name.
    #[arg(long)]
    consumer: String,
    /// The tenant scope, if the key was claimed in one.
    #[arg(long)]
    scope: Option<String>,
}

#[derive(Subcommand)]
enum DlqCommand {
    /// List dead letters, oldest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
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
    /// Delete every dead letter.
    Purge,
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    // A file named on the command line must exist. JUSTONCE_CONFIG may name an absent one,
    // as the default may be: the container image sets it and runs on variables alone.
    let named_by =
        (matches.value_source("config") == Some(ValueSource::CommandLine)).then_some("--config");
    if let Command::Completions { shell } = cli.command {
        clap_complete::generate(
            shell,
            &mut Cli::command(),
            "justonce",
            &mut std::io::stdout(),
        );
        return ExitCode::SUCCESS;
    }
    // The bench fills tables with statements meant to be slow: sqlx's warning about each
    // would bury its progress.
    let default_filter = match cli.command {
        Command::Bench(_) => "info,sqlx::query=error",
        _ => "info",
    };
    // The file may choose the log format: logging starts once it is read.
    let settings = config::load(&cli.config, named_by, &config::process_env());
    let format = match (&settings, cli.log_format) {
        (_, Some(format)) => format,
        (Ok(settings), None) => settings.log_format,
        (Err(_), None) => logs::LogFormat::default(),
    };
    // Only the service's spans are worth a trace.
    let traces_url = match (&cli.command, &settings) {
        (Command::Serve, Ok(settings)) => settings.traces_url.as_deref(),
        _ => None,
    };
    // Dropped after the runtime: the spans of everything below are flushed.
    let _traces = match logs::init(format, default_filter, traces_url) {
        Ok(traces) => traces,
        Err(error) => {
            report(format, &error);
            return ExitCode::FAILURE;
        }
    };
    let settings = match settings {
        Ok(settings) => settings,
        Err(error) => {
            report(format, &error);
            return ExitCode::from(2);
        }
    };
    for variable in &settings.unknown_variables {
        if cli.strict {
            let refused =
                anyhow::anyhow!("{variable}: no setting has this name (refused by --strict)");
            report(format, &refused);
        } else {
            tracing::warn!("{variable}: no setting has this name; it is ignored");
        }
    }
    if cli.strict && !settings.unknown_variables.is_empty() {
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            report(format, &anyhow::anyhow!("cannot start: {error}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(settings, cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.is::<errors::Usage>() => {
            report(format, &error);
            ExitCode::from(2)
        }
        Err(error) => {
            report(format, &error);
            ExitCode::FAILURE
        }
    }
}

/// Says why the command ends: a plain line, or a JSON error line among the others.
fn report(format: logs::LogFormat, error: &anyhow::Error) {
    let reason = reason(error);
    match format {
        logs::LogFormat::Text => eprintln!("justonce: {reason}"),
        logs::LogFormat::Json => tracing::error!("{reason}"),
    }
}

/// The error and its causes, each said once: a cause that its error's text already holds
/// is left out, and a store error ends the line with the database's own words.
fn reason(error: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        if let Some(store) = cause.downcast_ref::<justonce_sql::Error>() {
            parts.push(errors::store_error(store));
            break;
        }
        let text = cause.to_string();
        if !parts.last().is_some_and(|last| last.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}
