//! `justonce migrate`: create or update the tables, or print the SQL that would.

use super::output::counted;
use anyhow::Result;
use justonce_cli_support::database::DatabaseKind;
use justonce_sql::sqlx::{MySql, Postgres, Sqlite};
use justonce_sql::{Backend, Inbox, InboxOptions};

/// `--print-sql`: the migrations after `since`, printed from the dialect alone, so that the
/// database need not be reachable.
pub fn print_sql(kind: DatabaseKind, since: i64) -> Result<()> {
    let options = InboxOptions::default();
    let script = match kind {
        DatabaseKind::Sqlite => Inbox::<Sqlite>::migration_sql(&options, since)?,
        DatabaseKind::Postgres => Inbox::<Postgres>::migration_sql(&options, since)?,
        DatabaseKind::MySql => Inbox::<MySql>::migration_sql(&options, since)?,
    };
    print!("{script}");
    Ok(())
}

/// Applies the migrations the database lacks and says how many.
pub async fn apply<DB: Backend>(inbox: &Inbox<DB>) -> Result<()> {
    let applied = inbox.migrate().await?;
    println!("{} applied", counted(applied, "migration", "migrations"));
    Ok(())
}
