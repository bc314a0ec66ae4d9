//! A worker for the lease process tests: takes a lease on one key, waits for its parent's
//! word, then completes the key with its own result.
//!
//! `lease-worker <store-url> <prefix> <key> <lease-ms> <result>`
//!
//! The store is a `sqlite:`, `postgres:`, `mysql:` or `redis:` URL; the prefix is the table prefix
//! or the Redis key prefix. The worker prints `acquired <token>`, `in-progress`, `done
//! <result>` or `reused`. Once acquired it waits for a line on standard input, then
//! completes and prints `completed`, or `lost` (exit code 3) if another holder took the key
//! over meanwhile.

use justonce_core::{Consumer, Fingerprint, Identity, Key, LeaseClaim, Leases, Retention, Scope};
use justonce_redis::RedisLeases;
use justonce_sql::{Inbox, InboxOptions};
use sqlx::{MySql, Postgres, Sqlite};
use std::process::ExitCode;
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, prefix, key, lease_ms, result] = args.as_slice() else {
        eprintln!("usage: lease-worker <store-url> <prefix> <key> <lease-ms> <result>");
        return ExitCode::from(2);
    };
    let Ok(lease_ms) = lease_ms.parse::<u64>() else {
        eprintln!("lease-worker: <lease-ms> must be a number");
        return ExitCode::from(2);
    };
    let lease_for = Duration::from_millis(lease_ms);
    let outcome = match url.split(':').next() {
        Some("sqlite") => work(sql::<Sqlite>(url, prefix).await, key, lease_for, result).await,
        Some("postgres") => work(sql::<Postgres>(url, prefix).await, key, lease_for, result).await,
        Some("mysql") => work(sql::<MySql>(url, prefix).await, key, lease_for, result).await,
        Some("redis") => {
            let store = RedisLeases::connect(url, Retention::default())
                .await
                .map(|leases| leases.prefix(prefix));
            work(store, key, lease_for, result).await
        }
        _ => {
            eprintln!("lease-worker: unknown store {url}");
            return ExitCode::from(2);
        }
    };
    match outcome {
        Ok(code) => code,
        Err(error) => {
            eprintln!("lease-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn sql<DB: justonce_sql::Backend>(
    url: &str,
    prefix: &str,
) -> Result<Inbox<DB>, justonce_core::Error> {
    let consumer = Consumer::new("test")?;
    Inbox::<DB>::connect_with(url, consumer, InboxOptions::default().prefix(prefix)).await
}

async fn work(
    store: Result<impl Leases, justonce_core::Error>,
    key: &str,
    lease_for: Duration,
    result: &str,
) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let store = store?;
    let identity = Identity::new(Scope::none(), Consumer::new("test")?, Key::new(key)?);
    let claim = store
        .claim_lease(&identity, &Fingerprint::of(key), lease_for)
        .await?;
    let lease = match claim {
        LeaseClaim::Acquired(lease) => lease,
        LeaseClaim::InProgress { .. } => return say("in-progress", ExitCode::SUCCESS),
        LeaseClaim::Done { result } => {
            let result = String::from_utf8_lossy(result.as_deref().unwrap_or_default());
            return say(&format!("done {result}"), ExitCode::SUCCESS);
        }
        LeaseClaim::KeyReused { .. } => return say("reused", ExitCode::SUCCESS),
    };
    say(&format!("acquired {}", lease.token), ExitCode::SUCCESS)?;
    let mut word = String::new();
    std::io::stdin().read_line(&mut word)?;
    match store.complete(&lease, result.as_bytes()).await {
        Ok(()) => say("completed", ExitCode::SUCCESS),
        Err(justonce_core::Error::LeaseLost { .. }) => say("lost", ExitCode::from(3)),
        Err(error) => Err(error.into()),
    }
}

fn say(line: &str, code: ExitCode) -> Result<ExitCode, Box<dyn std::error::Error>> {
    use std::io::Write;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(code)
}
