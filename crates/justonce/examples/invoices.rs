//! A monthly invoice job that runs once per customer and month, however often it is started.
//!
//! ```text
//! cargo run --example invoices -- --database sqlite://invoices.db --month 2026-10
//! cargo run --example invoices -- --database postgres://postgres@127.0.0.1/test --month 2026-10
//! cargo run --example invoices -- --database mysql://root@127.0.0.1/test --month 2026-10
//! ```
//!
//! Each customer's invoice is keyed `invoice:<month>:<customer>`. In one transaction the job
//! claims the key, writes the invoice and writes an outbox row for the invoice email. Run it
//! twice: the second run creates nothing and changes no row.

use justonce::sqlx::{
    self, AssertSqlSafe, Database, Encode, Executor, IntoArguments, MySql, Postgres, Sqlite, Type,
};
use justonce::{Backend, Consumer, Inbox, Key, OutboxMessage, Outcome, RunError};
use std::process::ExitCode;

const CUSTOMERS: [(&str, i64); 5] = [
    ("cust_101", 12_000),
    ("cust_245", 4_990),
    ("cust_387", 25_000),
    ("cust_481", 9_900),
    ("cust_512", 1_500),
];

/// What can fail inside one customer's transaction.
#[derive(Debug, thiserror::Error)]
enum JobError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] justonce::Error),
}

#[derive(Debug, thiserror::Error)]
enum InvoiceError {
    #[error(transparent)]
    Job(#[from] JobError),
    #[error(transparent)]
    Run(#[from] RunError<JobError>),
    #[error("usage: invoices --database <url> --month <YYYY-MM>")]
    Usage,
}

impl From<sqlx::Error> for InvoiceError {
    fn from(error: sqlx::Error) -> Self {
        Self::Job(error.into())
    }
}

impl From<justonce::Error> for InvoiceError {
    fn from(error: justonce::Error) -> Self {
        Self::Job(error.into())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(InvoiceError::Usage) => {
            eprintln!("{}", InvoiceError::Usage);
            ExitCode::from(2)
        }
        Err(error) => {
            eprintln!("invoices: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), InvoiceError> {
    let mut args = std::env::args().skip(1);
    let (mut database, mut month) = (None, None);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--database" => database = args.next(),
            "--month" => month = args.next(),
            _ => return Err(InvoiceError::Usage),
        }
    }
    let (Some(database), Some(month)) = (database, month) else {
        return Err(InvoiceError::Usage);
    };
    let is_month = |m: &str| {
        let (year, month) = m.split_once('-').unwrap_or_default();
        year.len() == 4
            && year.bytes().all(|b| b.is_ascii_digit())
            && matches!(month.parse::<u8>(), Ok(1..=12))
            && month.len() == 2
    };
    if !is_month(&month) {
        return Err(InvoiceError::Usage);
    }
    let billing = Consumer::new("billing")?;
    // MySQL's parameters are `?`; the others number theirs.
    if database.starts_with("postgres:") || database.starts_with("postgresql:") {
        let inbox = Inbox::<Postgres>::connect(&database, billing).await?;
        invoice_month(inbox, &month, "$1, $2, $3").await
    } else if database.starts_with("mysql:") {
        let inbox = Inbox::<MySql>::connect(&database, billing).await?;
        invoice_month(inbox, &month, "?, ?, ?").await
    } else {
        let inbox = Inbox::<Sqlite>::connect(&database, billing).await?;
        invoice_month(inbox, &month, "$1, $2, $3").await
    }
}

/// Generic over the database so that one example runs on both; an application names its
/// own database and needs none of these bounds.
async fn invoice_month<DB>(
    inbox: Inbox<DB>,
    month: &str,
    parameters: &str,
) -> Result<(), InvoiceError>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    inbox.migrate().await?;
    // Two jobs started at once may both create the table, and on PostgreSQL the loser of
    // that race fails even with IF NOT EXISTS; asked again, it finds the table.
    let create = "CREATE TABLE IF NOT EXISTS invoices (
        month VARCHAR(7) NOT NULL,
        customer VARCHAR(64) NOT NULL,
        amount_cents BIGINT NOT NULL
    )";
    if sqlx::raw_sql(create).execute(inbox.pool()).await.is_err() {
        sqlx::raw_sql(create).execute(inbox.pool()).await?;
    }

    let insert =
        format!("INSERT INTO invoices (month, customer, amount_cents) VALUES ({parameters})");
    let (mut created, mut skipped) = (0, 0);
    for (customer, amount_cents) in CUSTOMERS {
        let key = &Key::purpose(["invoice", month, customer])?;
        let job = format!("{month} {customer} {amount_cents}");
        // The work may run more than once (after a serialization failure), so it borrows
        // what it needs rather than moving it.
        let (inbox, insert) = (&inbox, &insert);
        let outcome = inbox
            .run(key, job.as_bytes(), |tx| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(insert.as_str()))
                        .bind(month)
                        .bind(customer)
                        .bind(amount_cents)
                        .execute(&mut **tx)
                        .await?;
                    let email = format!("Your invoice for {month}: {amount_cents} cents");
                    inbox
                        .enqueue(tx, key, "invoice-email", OutboxMessage::new("email", email))
                        .await?;
                    Ok::<_, JobError>(())
                })
            })
            .await?;
        match outcome {
            Outcome::Processed(()) => created += 1,
            Outcome::Duplicate => skipped += 1,
            Outcome::KeyReused { .. } => {
                eprintln!("{key}: already invoiced with other data; skipped");
                skipped += 1;
            }
        }
    }
    println!("created {created} invoices, skipped {skipped} already invoiced");
    Ok(())
}
