//! A relay process for the crash tests: sends outbox rows to an HTTP receiver, and can stop
//! right after a receiver accepted a row and before the row is marked sent.
//!
//! `relay-worker <database-url> <prefix> <receiver-url> <lease-ms> <pause-after-sends> [key-per-try]`
//!
//! With `pause-after-sends` N > 0 the worker prints `paused after-send` once N rows were
//! accepted, before recording the Nth, and waits to be killed. With 0 it relays until no
//! row is left unsent, then prints `drained` and exits.
//!
//! `key-per-try` is deliberately broken, for the fault harness's own test: each try of a
//! row carries a key of its own, so that a receiver acting once per key acts again on a row
//! sent again.

use justonce_http::HttpDestination;
use justonce_sql::{Consumer, Delivered, Delivery, Destination, Inbox, InboxOptions, RelayOptions};
use justonce_tests::TestBackend;
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (url, prefix, receiver, lease_ms, pause_after, key_per_try) = match args.as_slice() {
        [url, prefix, receiver, lease_ms, pause_after] => {
            (url, prefix, receiver, lease_ms, pause_after, false)
        }
        [url, prefix, receiver, lease_ms, pause_after, mode] if mode == "key-per-try" => {
            (url, prefix, receiver, lease_ms, pause_after, true)
        }
        _ => {
            eprintln!(
                "usage: relay-worker <database-url> <prefix> <receiver-url> <lease-ms> <pause-after-sends> [key-per-try]"
            );
            return ExitCode::from(2);
        }
    };
    let (Ok(lease_ms), Ok(pause_after)) = (lease_ms.parse(), pause_after.parse()) else {
        eprintln!("relay-worker: lease-ms and pause-after-sends are numbers");
        return ExitCode::from(2);
    };
    let result = justonce_tests::with_backend!(url, DB => relay::<DB>(url, prefix, receiver, lease_ms, pause_after, key_per_try).await);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("relay-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Passes deliveries to the HTTP destination and stops after the Nth accepted one.
struct PausingAfterSend {
    inner: HttpDestination,
    accepted: AtomicU64,
    pause_after: u64,
    key_per_try: bool,
}

impl Destination for PausingAfterSend {
    fn deliver<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>> {
        Box::pin(async move {
            let key_of_this_try;
            let delivery = if self.key_per_try {
                key_of_this_try = format!("{}#{}", delivery.key, delivery.attempt);
                Delivery {
                    key: &key_of_this_try,
                    ..delivery
                }
            } else {
                delivery
            };
            let delivered = self.inner.deliver(delivery).await;
            if delivered == Delivered::Sent
                && self.accepted.fetch_add(1, Ordering::SeqCst) + 1 == self.pause_after
            {
                println!("paused after-send");
                std::io::stdout().flush().expect("stdout");
                std::future::pending::<()>().await;
            }
            delivered
        })
    }
}

async fn relay<DB: TestBackend>(
    url: &str,
    prefix: &str,
    receiver: &str,
    lease_ms: u64,
    pause_after: u64,
    key_per_try: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let inbox = Inbox::<DB>::connect_with(
        url,
        Consumer::new("relay")?,
        InboxOptions::default().prefix(prefix),
    )
    .await?;
    let destination = PausingAfterSend {
        inner: HttpDestination::new(receiver)?,
        accepted: AtomicU64::new(0),
        pause_after,
        key_per_try,
    };
    let options = RelayOptions::default()
        .lease(Duration::from_millis(lease_ms))
        .batch_size(50);
    let relay = inbox
        .outbox()
        .relay()
        .options(options)
        .destination("hooks", destination);
    loop {
        let round = relay.relay_once().await?;
        if round.taken == 0 {
            let unsent = DB::count(
                inbox.pool(),
                format!("SELECT count(*) FROM {prefix}outbox WHERE sent_at IS NULL"),
            )
            .await;
            if unsent == 0 {
                println!("drained");
                return Ok(());
            }
            // Rows a killed relay took come back when their lease ends.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
