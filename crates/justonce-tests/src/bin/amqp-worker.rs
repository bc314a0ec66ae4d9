//! A RabbitMQ consumer for the crash tests, writing one effect row per key.
//!
//! `amqp-worker <database-url> <prefix> <amqp-url> <queue> <mode>`
//!
//! `pause-after-commit`: takes one delivery, runs its work and commits, prints `committed
//! <key> <outcome>`, then waits to be killed before it could acknowledge. `run`: prints
//! `running` and consumes until it is killed.

use justonce_sql::{Consumer, Inbox, Options};
use justonce_tests::TestBackend;
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use justonce_transport::{ConsumerStats, Ran};
use sqlx::{Postgres, Sqlite};
use std::io::Write;
use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, prefix, amqp, queue, mode] = args.as_slice() else {
        eprintln!("usage: amqp-worker <database-url> <prefix> <amqp-url> <queue> <mode>");
        return ExitCode::from(2);
    };
    let result = if url.starts_with("sqlite:") {
        work::<Sqlite>(url, prefix, amqp, queue, mode).await
    } else {
        work::<Postgres>(url, prefix, amqp, queue, mode).await
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("amqp-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn work<DB: TestBackend>(
    url: &str,
    prefix: &str,
    amqp: &str,
    queue: &str,
    mode: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let inbox = Inbox::<DB>::connect_with(
        url,
        Consumer::new("test")?,
        Options::default().prefix(prefix),
    )
    .await?;
    let consumer = AmqpConsumer::connect(amqp, inbox.clone(), AmqpOptions::new(queue)).await?;
    let work = justonce_tests::consumer_work::<DB>(prefix);
    if mode == "run" {
        println!("running");
        std::io::stdout().flush()?;
        consumer.run(std::future::pending::<()>(), work).await?;
        return Ok(());
    }
    let mut deliveries = consumer.deliveries().await?;
    let delivery = deliveries
        .next()
        .await?
        .ok_or("the consumer was cancelled")?;
    let key = delivery.key().map_err(str::to_owned)?.clone();
    let ran = delivery.run(&inbox, &work).await;
    let Ran::Outcome(outcome) = ran else {
        return Err(format!("the work did not commit: {ran:?}").into());
    };
    println!("committed {key} {outcome:?}");
    std::io::stdout().flush()?;
    // The commit is durable and the delivery not acknowledged: the parent kills us here.
    std::future::pending::<()>().await;
    delivery
        .settle(
            Ran::<sqlx::Error>::Outcome(outcome),
            &mut ConsumerStats::default(),
        )
        .await?;
    Ok(())
}
