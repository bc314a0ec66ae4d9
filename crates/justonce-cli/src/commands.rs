//! Each command against the configured database.

use crate::config::Settings;
use crate::{Command, DlqCommand, KeysCommand};
use anyhow::{Context, Result};
use justonce_sql::sqlx::{MySql, Postgres, Sqlite};
use justonce_sql::{Backend, Consumer, Identity, Inbox, Key, Options, Row, Scope, StoredKey};

/// Opens the store the settings name and runs `command` on it.
pub async fn run(settings: Settings, command: Command) -> Result<()> {
    if let Command::Migrate {
        print_sql: true,
        since,
    } = command
    {
        // Printed from the dialect alone: the database need not be reachable.
        let options = Options::default();
        let script = match Database::of(&settings.database) {
            Database::Sqlite => Inbox::<Sqlite>::migration_sql(&options, since)?,
            Database::Postgres => Inbox::<Postgres>::migration_sql(&options, since)?,
            Database::MySql => Inbox::<MySql>::migration_sql(&options, since)?,
        };
        print!("{script}");
        return Ok(());
    }
    match Database::of(&settings.database) {
        Database::Sqlite => run_on::<Sqlite>(settings, command).await,
        Database::Postgres => run_on::<Postgres>(settings, command).await,
        Database::MySql => run_on::<MySql>(settings, command).await,
    }
}

/// The database a URL names, by its scheme, which the settings already checked.
enum Database {
    Sqlite,
    Postgres,
    MySql,
}

impl Database {
    fn of(url: &str) -> Self {
        if url.starts_with("sqlite:") {
            Self::Sqlite
        } else if url.starts_with("mysql:") {
            Self::MySql
        } else {
            Self::Postgres
        }
    }
}

async fn run_on<DB: Backend>(settings: Settings, command: Command) -> Result<()> {
    let options = Options::default().retention(settings.store_retention()?);
    let inbox = Inbox::<DB>::connect_with(&settings.database, Consumer::new("justonce")?, options)
        .await
        .context("opening the database")?;
    let outbox = inbox.outbox();
    match command {
        Command::Serve => {
            inbox.migrate().await?;
            crate::serve::serve(settings, inbox).await?
        }
        Command::Migrate { .. } => {
            let applied = inbox.migrate().await?;
            println!("{applied} migrations applied");
        }
        Command::Check => {
            inbox.check().await?;
            println!(
                "configuration and database are fine: {} sources, {} consumers",
                settings.sources.len(),
                settings.consumers.len()
            );
        }
        Command::Purge { batch_size } => {
            let mut keys = 0;
            let sources = settings.sources.iter().map(|s| (&s.name, s.retention));
            let consumers = settings.consumers.iter().map(|c| (&c.name, c.retention));
            for (name, retention) in sources.chain(consumers) {
                let consumer = inbox.with_consumer(Consumer::new(name.as_str())?);
                keys += consumer.purge(retention.keep(), batch_size).await?;
            }
            let keep_sent = settings.store_retention()?.keep();
            let sent = outbox.purge_sent(keep_sent, batch_size).await?;
            println!("purged {keys} keys and {sent} sent deliveries");
        }
        Command::Stats => {
            let stats = outbox.stats().await?;
            println!(
                "deliveries: {} sent, {} due, {} dead",
                stats.sent, stats.due, stats.dead
            );
        }
        Command::Dlq { command } => dlq(&outbox, command).await?,
        Command::Keys {
            command:
                KeysCommand::Show {
                    key,
                    consumer,
                    scope,
                },
        } => {
            let scope = scope
                .map(Scope::new)
                .transpose()?
                .unwrap_or_else(Scope::none);
            let identity = Identity::new(scope, Consumer::new(consumer)?, Key::new(key)?);
            let stored = inbox.lookup(&identity).await?.with_context(|| {
                format!("no key {} for consumer {}", identity.key, identity.consumer)
            })?;
            print_key(&identity, &stored);
        }
    }
    Ok(())
}

async fn dlq<DB: Backend>(outbox: &justonce_sql::Outbox<DB>, command: DlqCommand) -> Result<()> {
    match command {
        DlqCommand::List { limit } => {
            for row in outbox.dead_letters(limit).await? {
                println!(
                    "{}\t{}\t{}\t{} attempts\t{}",
                    row.id,
                    row.destination,
                    row.key,
                    row.attempts,
                    row.last_error.as_deref().unwrap_or("")
                );
            }
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
            println!("{} dead letters are due again", outbox.replay_all().await?);
        }
        DlqCommand::Purge => {
            println!(
                "{} dead letters deleted",
                outbox.purge_dead_letters().await?
            );
        }
    }
    Ok(())
}

fn print_key(identity: &Identity, stored: &StoredKey) {
    let scope = match identity.scope.as_str() {
        "" => "(none)",
        scope => scope,
    };
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
    println!("state:       {state} after {} attempts", row.attempts);
    if let Some(error) = &row.last_error {
        println!("last error:  {error}");
    }
    for (name, value) in &row.headers {
        println!("header:      {name}: {value}");
    }
    println!();
    println!("{}", String::from_utf8_lossy(&row.payload));
}
