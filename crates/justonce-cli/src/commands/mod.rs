//! Each command against the configuration, and the store it names: one room per command
//! family.

mod bench;
mod check;
pub(crate) mod deliveries;
mod dlq;
pub(crate) mod events;
pub(crate) mod keys;
mod migrate;
pub(crate) mod output;
mod purge;
pub(crate) mod stats;

use crate::cli::{
    Configured, DeliveriesCommand, DlqCommand, EventsCommand, KeysCommand, ReplayArgs,
};
use crate::config::Settings;
use crate::errors::{opening_failed, sqlite_file};
use anyhow::Result;
use justonce_cli_support::database::DatabaseKind;
use justonce_sql::sqlx::{MySql, Postgres, Sqlite};
use justonce_sql::{Backend, Consumer, Inbox, InboxOptions};

/// A command that works on the store, which [`run`] opens for it.
enum OnStore {
    Serve,
    Migrate,
    /// `check` with neither a target nor a job: the configuration and its surroundings.
    Check,
    Purge {
        batch_size: u32,
        pause: f64,
    },
    Stats {
        json: bool,
    },
    Dlq(DlqCommand),
    Deliveries(DeliveriesCommand),
    Events(EventsCommand),
    Replay(ReplayArgs),
    Keys(KeysCommand),
}

impl OnStore {
    /// Whether it creates or updates the tables, as serve and migrate do; the others only
    /// read and change what the tables hold.
    fn migrates(&self) -> bool {
        matches!(self, Self::Serve | Self::Migrate)
    }
}

/// Runs `command`: on the settings alone if it needs no store, else on the store they name.
pub async fn run(mut settings: Settings, command: Configured) -> Result<()> {
    let command = match command {
        Configured::Config => {
            print!("{}", settings.printed);
            return Ok(());
        }
        Configured::Bench(args) => return bench::run(&settings, args).await,
        Configured::Migrate {
            print_sql: true,
            since,
        } => return migrate::print_sql(database_kind(&settings.database)?, since),
        Configured::Check(args) => match args.subject()? {
            Some(subject) => return check::conformance(&settings, args, subject).await,
            None => OnStore::Check,
        },
        Configured::Serve { role } => {
            if let Some(roles) = role {
                settings.roles = roles;
            }
            OnStore::Serve
        }
        Configured::Migrate {
            print_sql: false, ..
        } => OnStore::Migrate,
        Configured::Purge { batch_size, pause } => OnStore::Purge { batch_size, pause },
        Configured::Stats { json } => OnStore::Stats { json },
        Configured::Dlq { command } => OnStore::Dlq(command),
        Configured::Deliveries { command } => OnStore::Deliveries(command),
        Configured::Events { command } => OnStore::Events(command),
        Configured::Replay(args) => OnStore::Replay(args),
        Configured::Keys { command } => OnStore::Keys(command),
    };
    if let Some(file) = sqlite_file(&settings.database)
        && !command.migrates()
        && !file.exists()
    {
        // Only a command that migrates creates the file: a command that reads it, run in the
        // wrong folder or before the first migrate, must not leave an empty one behind.
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
    Ok(DatabaseKind::named_by(url, "server.database")?)
}

async fn run_on<DB: Backend>(settings: Settings, command: OnStore) -> Result<()> {
    let options = InboxOptions::default()
        .retention(settings.store_retention()?)
        .pool_size(settings.pool_size)
        .acquire_timeout(settings.acquire_timeout);
    let inbox = Inbox::<DB>::connect_with(&settings.database, Consumer::new("justonce")?, options)
        .await
        .map_err(|error| opening_failed(error, "the database", &settings.database))?;
    if !command.migrates() {
        // Before the first migrate, say so rather than fail on a missing table.
        inbox.check().await?;
    }
    match command {
        OnStore::Serve => {
            crate::serve::check_failpoint()?;
            inbox.migrate().await?;
            crate::serve::serve(settings, inbox).await
        }
        OnStore::Migrate => migrate::apply(&inbox).await,
        OnStore::Check => check::environment(&settings, &inbox).await,
        OnStore::Purge { batch_size, pause } => {
            purge::run(&settings, &inbox, batch_size, pause).await
        }
        OnStore::Stats { json } => stats::print(&inbox, json).await,
        OnStore::Dlq(command) => dlq::run(&inbox.outbox(), command).await,
        OnStore::Deliveries(command) => deliveries::run(&inbox.outbox(), command).await,
        OnStore::Events(command) => events::run(&settings, &inbox.outbox(), command).await,
        OnStore::Replay(args) => events::replay(&settings, &inbox.outbox(), args).await,
        OnStore::Keys(command) => keys::run(&inbox, command).await,
    }
}
