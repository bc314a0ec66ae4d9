//! A single reader of a synthetic stream for the offset crash test: resumes after its stored
//! offset and, for each entry, writes one effect row and the entry's offset in one
//! transaction, rolled back if the offset did not move.
//!
//! `stream-worker <database-url> <prefix> <entries>`: prints `done` after the last entry.

use justonce_sql::{Consumer, Inbox, InboxOptions, Offset, OffsetCommit};
use justonce_tests::TestBackend;
use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, prefix, entries] = args.as_slice() else {
        eprintln!("usage: stream-worker <database-url> <prefix> <entries>");
        return ExitCode::from(2);
    };
    let Ok(entries) = entries.parse() else {
        eprintln!("stream-worker: entries is a number");
        return ExitCode::from(2);
    };
    let result = justonce_tests::with_backend!(url, DB => read::<DB>(url, prefix, entries).await);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("stream-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn read<DB: TestBackend>(
    url: &str,
    prefix: &str,
    entries: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    let inbox = Inbox::<DB>::connect_with(
        url,
        Consumer::new("stream")?,
        InboxOptions::default().prefix(prefix),
    )
    .await?;
    let resume_at = match inbox.load_offsets("orders").await?.first() {
        Some((_, offset)) => offset.position + 1,
        None => 0,
    };
    for entry in resume_at..entries {
        let mut tx = inbox.begin().await?;
        DB::insert_effect(&mut tx, prefix, "stream", &format!("entry:{entry}")).await?;
        // A reader killed after sending COMMIT may commit after this one loaded the
        // offsets: then the offset does not move, and this entry is a duplicate.
        match inbox
            .commit_offset(&mut tx, "orders", 0, Offset::from(entry))
            .await?
        {
            OffsetCommit::Moved => tx.commit().await?,
            OffsetCommit::AlreadyProcessed => tx.rollback().await?,
        }
    }
    println!("done");
    Ok(())
}
