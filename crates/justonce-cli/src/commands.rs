//! Each command against the configured database.

use crate::config::{BrokerOptions, ConsumerSettings, Settings};
use crate::errors::{Usage, opening_failed, sqlite_file};
use crate::{CheckArgs, Command, DlqCommand, KeyArgs, KeysCommand};
use crate::{check, listener, purge};
use anyhow::{Context, Result};
use justonce_cli_support::database::DatabaseKind;
use justonce_cli_support::pacing::Pacer;
use justonce_cli_support::progress::Progress;
use justonce_sql::sqlx::{MySql, Postgres, Sqlite};
use justonce_sql::{Backend, Consumer, Identity, Inbox, InboxOptions, Key, Row, Scope, StoredKey};
use std::hash::{BuildHasher, RandomState};
use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

/// Dead letters replayed per statement by `dlq replay --all`.
const REPLAY_BATCH: u32 = 1_000;

/// Opens the store the settings name and runs `command` on it.
pub async fn run(settings: Settings, command: Command) -> Result<()> {
    if let Command::Bench(args) = command {
        let url = args.database().unwrap_or(&settings.database).to_owned();
        return justonce_bench::run(&url, &args.try_into()?, serve_receiver).await;
    }
    if let Command::Config = command {
        print!("{}", settings.printed);
        return Ok(());
    }
    if let Command::Check(args) = &command
        && (args.target.is_some() || args.run.is_some())
    {
        return check(&settings, args).await;
    }
    if let Command::Migrate {
        print_sql: true,
        since,
    } = command
    {
        // Printed from the dialect alone: the database need not be reachable.
        let options = InboxOptions::default();
        let script = match database_kind(&settings.database)? {
            DatabaseKind::Sqlite => Inbox::<Sqlite>::migration_sql(&options, since)?,
            DatabaseKind::Postgres => Inbox::<Postgres>::migration_sql(&options, since)?,
            DatabaseKind::MySql => Inbox::<MySql>::migration_sql(&options, since)?,
        };
        print!("{script}");
        return Ok(());
    }
    if let Some(file) = sqlite_file(&settings.database)
        && !matches!(command, Command::Serve | Command::Migrate { .. })
        && !file.exists()
    {
        // Only serve and migrate create the file: a command that reads it, run in the wrong
        // folder or before the first migrate, must not leave an empty one behind.
        anyhow::bail!(
            "the database file {} does not exist: `justonce migrate` creates it",
            file.display()
        );
    }
    match database_kind(&settings.database)? {
        DatabaseKind::Sqlite => run_on::<Sqlite>(settings, command).await,
        DatabaseKind::Postgres => run_on::<Postgres>(settings, command).await,
        DatabaseKind::MySql => run_on::<MySql>(settings, command).await,
    }
}

/// The kind of the configured database, which the settings already checked.
fn database_kind(url: &str) -> Result<DatabaseKind> {
    DatabaseKind::of(url).map_err(|unknown| Usage(format!("server.database: {unknown}")).into())
}

async fn run_on<DB: Backend>(settings: Settings, command: Command) -> Result<()> {
    let options = InboxOptions::default()
        .retention(settings.store_retention()?)
        .pool_size(settings.pool_size)
        .acquire_timeout(settings.acquire_timeout);
    let inbox = Inbox::<DB>::connect_with(&settings.database, Consumer::new("justonce")?, options)
        .await
        .map_err(|error| opening_failed(error, "the database", &settings.database))?;
    if !matches!(command, Command::Serve | Command::Migrate { .. }) {
        // Before the first migrate, say so rather than fail on a missing table.
        inbox.check().await?;
    }
    let outbox = inbox.outbox();
    match command {
        Command::Serve => {
            crate::serve::check_failpoint()?;
            inbox.migrate().await?;
            crate::serve::serve(settings, inbox).await?
        }
        Command::Migrate { .. } => {
            let applied = inbox.migrate().await?;
            println!("{} applied", counted(applied, "migration", "migrations"));
        }
        Command::Check(_) => {
            let brokers = check_environment(&settings).await?;
            println!(
                "configuration and database are fine: {}, {}, {}",
                counted(settings.sources.len(), "source", "sources"),
                counted(settings.consumers.len(), "consumer", "consumers"),
                counted(brokers, "broker reached", "brokers reached")
            );
        }
        Command::Purge { batch_size, pause } => {
            // One pacer for the whole purge: every statement loads the same database.
            let mut pacer = Pacer::new(pause);
            let mut progress = Progress::new();
            let purged = purge::Plan::of(&settings)?
                .run(&inbox, batch_size, &mut pacer, Some(&mut progress))
                .await?;
            println!(
                "purged {} and {}",
                counted(purged.keys, "key", "keys"),
                counted(purged.sent, "sent delivery", "sent deliveries")
            );
        }
        Command::Stats { json } => stats(&inbox, json).await?,
        Command::Dlq { command } => dlq(&outbox, command).await?,
        Command::Keys { command } => keys(&inbox, command).await?,
        Command::Bench(_) => unreachable!("run measures before it opens the store"),
        Command::Config => unreachable!("run prints the configuration before it opens the store"),
        Command::Completions { .. } => unreachable!("main prints completions without a store"),
    }
    Ok(())
}

/// `1 key`, `2 keys`: a count with its noun, `one` or `many`.
fn counted(count: impl TryInto<u64> + std::fmt::Display + Copy, one: &str, many: &str) -> String {
    match count.try_into() {
        Ok(1) => format!("1 {one}"),
        _ => format!("{count} {many}"),
    }
}

async fn keys<DB: Backend>(inbox: &Inbox<DB>, command: KeysCommand) -> Result<()> {
    match command {
        KeysCommand::Show { key } => {
            let identity = key.identity()?;
            let stored = lookup(inbox, &identity).await?;
            print_key(&identity, &stored);
        }
        KeysCommand::Release { key, yes } => {
            let identity = key.identity()?;
            show_lease_in_progress(inbox, &identity, "release").await?;
            confirm("Release this key, so that the next claim takes it?", yes)?;
            if !inbox.release_key(&identity).await? {
                anyhow::bail!("{} has no lease in progress any more", name(&identity));
            }
            println!("released: the next claim takes {} at once", identity.key);
        }
        KeysCommand::Complete { key, result, yes } => {
            let identity = key.identity()?;
            show_lease_in_progress(inbox, &identity, "complete").await?;
            let stored = match &result {
                Some(result) => format!("{} bytes of result", result.len()),
                None => "no result".to_owned(),
            };
            confirm(&format!("Mark this key done, with {stored}?"), yes)?;
            let result = result.as_deref().map(str::as_bytes);
            if !inbox.complete_key(&identity, result).await? {
                anyhow::bail!("{} has no lease in progress any more", name(&identity));
            }
            println!("completed: {} is done, with {stored}", identity.key);
        }
    }
    Ok(())
}

impl KeyArgs {
    /// The key's identity; a malformed key, consumer or scope is bad usage.
    fn identity(self) -> Result<Identity> {
        let usage = |error: justonce_sql::Error| Usage(error.to_string());
        let scope = match self.scope {
            Some(scope) => Scope::new(scope).map_err(usage)?,
            None => Scope::none(),
        };
        let consumer = Consumer::new(self.consumer).map_err(usage)?;
        let key = Key::new(self.key).map_err(usage)?;
        Ok(Identity::new(scope, consumer, key))
    }
}

/// The key, its consumer and its scope, as an error message names them.
fn name(identity: &Identity) -> String {
    match identity.scope.as_str() {
        "" => format!("key {} of consumer {}", identity.key, identity.consumer),
        scope => format!(
            "key {} of consumer {} in scope {scope}",
            identity.key, identity.consumer
        ),
    }
}

async fn lookup<DB: Backend>(inbox: &Inbox<DB>, identity: &Identity) -> Result<StoredKey> {
    inbox
        .lookup(identity)
        .await?
        .with_context(|| format!("no {} is stored", name(identity)))
}

/// Prints a key whose lease is in progress, which `action` is about to change; fails for
/// one that is missing or done.
async fn show_lease_in_progress<DB: Backend>(
    inbox: &Inbox<DB>,
    identity: &Identity,
    action: &str,
) -> Result<()> {
    let stored = lookup(inbox, identity).await?;
    if stored.lease_remaining.is_none() {
        anyhow::bail!(
            "{} is done: there is no lease in progress to {action}",
            name(identity)
        );
    }
    print_key(identity, &stored);
    Ok(())
}

/// Asks `question` on the terminal unless `yes`, and fails unless the answer is yes. With
/// no terminal to ask on, only `--yes` goes ahead.
fn confirm(question: &str, yes: bool) -> Result<()> {
    if yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Usage(
            "stdin is not a terminal to confirm on: pass --yes to go ahead; nothing changed"
                .to_owned(),
        )
        .into());
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    if matches!(answer.trim().to_lowercase().as_str(), "y" | "yes") {
        Ok(())
    } else {
        anyhow::bail!("not confirmed: nothing changed")
    }
}

async fn stats<DB: Backend>(inbox: &Inbox<DB>, json: bool) -> Result<()> {
    let keys = inbox.key_counts().await?;
    let deliveries = inbox.outbox().stats().await?;
    let backed_off = inbox.outbox().backed_off().await?;
    let offsets = inbox.all_offsets().await?;
    if json {
        let stats = serde_json::json!({
            "keys": keys.iter().map(|count| serde_json::json!({
                "consumer": count.consumer,
                "scope": (!count.scope.is_empty()).then_some(&count.scope),
                "keys": count.keys,
                "in_progress": count.in_progress,
            })).collect::<Vec<_>>(),
            "deliveries": {
                "sent": deliveries.sent,
                "due": deliveries.due,
                "dead": deliveries.dead,
                "oldest_due_age_seconds": deliveries.oldest_due.as_secs_f64(),
            },
            "backed_off": backed_off.iter().map(|destination| serde_json::json!({
                "destination": destination.destination,
                "failures": destination.failures,
                "pause_left_seconds": destination.pause_left.as_secs_f64(),
                "since_seconds": destination.since.as_secs_f64(),
            })).collect::<Vec<_>>(),
            "offsets": offsets.iter().map(|stored| serde_json::json!({
                "consumer": stored.consumer,
                "stream": stored.stream,
                "partition": stored.partition,
                "position": stored.offset.position,
                "sequence": stored.offset.sequence,
            })).collect::<Vec<_>>(),
        });
        println!("{stats}");
        return Ok(());
    }
    print_table(
        "keys",
        &["consumer", "scope", "keys", "in progress"],
        keys.iter()
            .map(|count| {
                vec![
                    count.consumer.clone(),
                    scope_or_none(&count.scope).to_owned(),
                    count.keys.to_string(),
                    count.in_progress.to_string(),
                ]
            })
            .collect(),
    );
    print_table(
        "deliveries",
        &["sent", "due", "dead", "oldest due"],
        vec![vec![
            deliveries.sent.to_string(),
            deliveries.due.to_string(),
            deliveries.dead.to_string(),
            // Nothing due has no age.
            match deliveries.due {
                0 => "(none)".to_owned(),
                _ => format!("{} s", deliveries.oldest_due.as_secs()),
            },
        ]],
    );
    print_table(
        "backed-off destinations",
        &["destination", "failures", "pause left", "since"],
        backed_off
            .iter()
            .map(|destination| {
                vec![
                    destination.destination.clone(),
                    destination.failures.to_string(),
                    format!("{} s", destination.pause_left.as_secs()),
                    format!("{} s ago", destination.since.as_secs()),
                ]
            })
            .collect(),
    );
    print_table(
        "offsets",
        &["consumer", "stream", "partition", "position", "sequence"],
        offsets
            .iter()
            .map(|stored| {
                vec![
                    stored.consumer.clone(),
                    stored.stream.clone(),
                    stored.partition.to_string(),
                    stored.offset.position.to_string(),
                    stored.offset.sequence.to_string(),
                ]
            })
            .collect(),
    );
    println!(
        "Duplicates and key reuses are not stored: the running service counts them since it \
         started, on the admin listener's /metrics."
    );
    Ok(())
}

/// Prints `rows` under `title` in aligned columns, or that there are none.
fn print_table(title: &str, header: &[&str], rows: Vec<Vec<String>>) {
    if rows.is_empty() {
        println!("{title}: none\n");
        return;
    }
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("  {}", padded.join("  ").trim_end());
    };
    println!("{title}");
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    println!();
}

fn scope_or_none(scope: &str) -> &str {
    match scope {
        "" => "(none)",
        scope => scope,
    }
}

async fn dlq<DB: Backend>(outbox: &justonce_sql::Outbox<DB>, command: DlqCommand) -> Result<()> {
    match command {
        DlqCommand::List { limit } => {
            let rows = outbox.dead_letters(limit).await?;
            print_table(
                "dead letters",
                &["id", "destination", "key", "attempts", "last error"],
                rows.into_iter()
                    .map(|row| {
                        vec![
                            row.id.to_string(),
                            row.destination,
                            row.key,
                            row.attempts.to_string(),
                            row.last_error.unwrap_or_default(),
                        ]
                    })
                    .collect(),
            );
        }
        DlqCommand::Show { id } => {
            let row = outbox
                .get(id)
                .await?
                .with_context(|| format!("no delivery has id {id}"))?;
            print_row(&row);
        }
        DlqCommand::Replay { id: Some(id), .. } => {
            if !outbox.replay(id).await? {
                anyhow::bail!("delivery {id} is not a dead letter");
            }
            println!("delivery {id} is due again");
        }
        DlqCommand::Replay { id: None, .. } => {
            // Bounded by the count at the start: a replayed row that dies again during the
            // replay is not replayed twice.
            let dead = u64::try_from(outbox.stats().await?.dead).unwrap_or(0);
            let mut progress = Progress::new();
            let mut replayed = 0;
            while replayed < dead {
                let batch = outbox.replay_batch(REPLAY_BATCH).await?;
                replayed += batch;
                progress.update(format!("dead letters: {replayed} of {dead} due again"));
                if batch < u64::from(REPLAY_BATCH) {
                    break;
                }
            }
            progress.finish();
            match replayed {
                1 => println!("1 dead letter is due again"),
                _ => println!("{replayed} dead letters are due again"),
            }
        }
        DlqCommand::Purge => {
            let deleted = outbox.purge_dead_letters().await?;
            println!(
                "{} deleted",
                counted(deleted, "dead letter", "dead letters")
            );
        }
    }
    Ok(())
}

fn print_key(identity: &Identity, stored: &StoredKey) {
    let scope = scope_or_none(identity.scope.as_str());
    let state = match stored.lease_remaining {
        None => "done".to_owned(),
        Some(remaining) if remaining.is_zero() => "in progress, lease ended".to_owned(),
        Some(remaining) => format!("in progress, lease ends in {} s", remaining.as_secs()),
    };
    let fingerprint: String = stored
        .fingerprint
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("key:         {}", identity.key);
    println!("consumer:    {}", identity.consumer);
    println!("scope:       {scope}");
    println!("state:       {state}");
    println!("fingerprint: {fingerprint}");
    match &stored.result {
        Some(result) => println!("result:      {} bytes", result.len()),
        None => println!("result:      none"),
    }
}

fn print_row(row: &Row) {
    let state = if row.sent {
        "sent"
    } else if row.dead {
        "dead"
    } else {
        "due"
    };
    println!("id:          {}", row.id);
    println!("destination: {}", row.destination);
    println!("key:         {}", row.key);
    println!(
        "state:       {state} after {}",
        counted(row.attempts, "attempt", "attempts")
    );
    if let Some(error) = &row.last_error {
        println!("last error:  {error}");
    }
    for (name, value) in &row.headers {
        println!("header:      {name}: {value}");
    }
    println!();
    println!("{}", String::from_utf8_lossy(&row.payload));
}

/// Resolves every source's and consumer's target host and probes every consumer's broker,
/// all at once, and names each that fails: one line each. A broker that refuses a consumer's
/// settings (its TLS handshake, its URL) is bad configuration, exit code 2, as it is for
/// `serve`; anything else that fails is a failure. Returns how many brokers it reached: the
/// consumers' distinct URLs.
async fn check_environment(settings: &Settings) -> Result<usize> {
    let targets = settings
        .sources
        .iter()
        .map(|source| ("source", &source.name, &source.destination))
        .chain(
            settings
                .consumers
                .iter()
                .map(|consumer| ("consumer", &consumer.name, &consumer.destination)),
        );
    let targets =
        futures_util::future::join_all(targets.map(|(kind, name, destination)| async move {
            let error = destination.resolve().await.err()?;
            Some((false, format!("{kind} {name}: {error}")))
        }));
    let brokers = futures_util::future::join_all(settings.consumers.iter().map(|consumer| async {
        let error = probe_broker(consumer).await.err()?;
        let misconfigured = matches!(
            error.kind(),
            justonce_transport::ErrorKind::Tls | justonce_transport::ErrorKind::Config
        );
        let problem = format!(
            "consumer {}: {}: {}",
            consumer.name,
            crate::config::redacted(&consumer.from),
            broker_problem(&consumer.name, &error)
        );
        Some((misconfigured, problem))
    }));
    let (targets, brokers) = tokio::join!(targets, brokers);
    let problems: Vec<(bool, String)> = targets.into_iter().chain(brokers).flatten().collect();
    if !problems.is_empty() {
        let lines: Vec<&str> = problems.iter().map(|(_, line)| line.as_str()).collect();
        let report = lines.join("\n");
        return Err(
            if problems.iter().any(|(misconfigured, _)| *misconfigured) {
                Usage(report).into()
            } else {
                anyhow::anyhow!(report)
            },
        );
    }
    let brokers: std::collections::BTreeSet<&str> =
        settings.consumers.iter().map(|c| c.from.as_str()).collect();
    Ok(brokers.len())
}

/// Connects to the consumer's broker with its settings and disconnects, within a few
/// seconds: see each broker's `probe`.
async fn probe_broker(consumer: &ConsumerSettings) -> Result<(), justonce_transport::Error> {
    let url = consumer.from.as_str();
    match &consumer.options {
        BrokerOptions::Amqp(options) => justonce_transport::amqp::probe(url, options).await,
        BrokerOptions::Nats(options) => justonce_transport::nats::probe(url, options).await,
        BrokerOptions::Redis(options) => {
            justonce_transport::redis_streams::probe(url, options).await
        }
        BrokerOptions::Mqtt(options) => justonce_transport::mqtt::probe(url, options).await,
    }
}

/// Why a consumer's broker failed its probe, in words; a refused TLS handshake with the
/// setting to look at.
fn broker_problem(name: &str, error: &justonce_transport::Error) -> String {
    match error {
        justonce_transport::Error::Tls(tls) => crate::serve::tls_advice(name, tls),
        error => error.to_string(),
    }
}

/// `justonce check` with a target or a job: the conformance kit.
async fn check(settings: &Settings, args: &CheckArgs) -> Result<()> {
    let effects = match (&args.effects, &args.count) {
        (Some(sql), None) => check::Effects::Rows(sql.clone()),
        (None, Some(sql)) => check::Effects::Count(sql.clone()),
        _ => return Err(Usage("the check needs --effects or --count".to_owned()).into()),
    };
    let target = match (&args.target, &args.run) {
        (Some(url), None) => check::Target::of(url, args.to.as_deref(), args.sign.as_deref())?,
        (None, Some(command)) => check::Target::Job(command.clone()),
        _ => unreachable!("clap lets one of the two through"),
    };
    let keys = if args.keys.is_empty() {
        let run = format!("{:08x}", RandomState::new().hash_one(Instant::now()) as u32);
        (1..=args.events)
            .map(|n| format!("check-{run}-{n}"))
            .collect()
    } else {
        let mut seen = std::collections::HashSet::new();
        if let Some(repeated) = args.keys.iter().find(|key| !seen.insert(key.as_str())) {
            return Err(Usage(format!("--keys names {repeated:?} twice")).into());
        }
        args.keys.clone()
    };
    check::run(check::Settings {
        target,
        effects,
        database: args
            .database
            .clone()
            .unwrap_or_else(|| settings.database.clone()),
        keys,
        body: args.body.clone(),
        headers: args.headers.clone(),
        between: args.between.clone(),
        delay: args.delay,
        wait: args.wait,
        json: args.json,
    })
    .await
}

/// The bench's receiver behind the service's own listener and its default caps.
fn serve_receiver(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> futures_util::future::BoxFuture<'static, ()> {
    Box::pin(async move {
        let limits = crate::config::Limits::default();
        let stopped = std::future::pending();
        listener::serve(
            listener,
            app,
            limits,
            limits.max_connections,
            false,
            stopped,
        )
        .await;
    })
}
