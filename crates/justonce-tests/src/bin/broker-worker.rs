//! A broker consumer for the crash tests, writing one effect row per key: RabbitMQ for an
//! `amqp://` URL, NATS JetStream for a `nats://` one, Redis Streams for a `redis://` one,
//! MQTT for an `mqtt://` one, Kafka for a `kafka://` one.
//!
//! `broker-worker <database-url> <prefix> <broker-url> <queue> <kind> <mode> [quorum]`
//!
//! The queue is a RabbitMQ queue (the key is the `message_id`), or the JetStream stream,
//! subject and durable consumer of that name (the key is the `Order-Id` header), or the
//! Redis stream of that name, read in group `test` (the key is the `key` field), or the
//! MQTT topic of that name, on the persistent session of client `<queue>-c` (the key is the
//! `key` user property, dead letters go to `<queue>/dead`), or the Kafka topic of that name, read in the group of that name (the
//! key is the `ce_id` header). `kind` is `consumer`, or `reader` for the single readers of NATS and
//! Redis and for Kafka, which keep their offset in the database, or `member-<n>` for a consumer that shares
//! the queue with others: on MQTT, client `<queue>-m<n>` in the shared subscription of group
//! `test`; elsewhere a plain consumer (on Kafka, every kind is a member of the group).
//! `pause-after-commit`: takes one message, runs its work and commits, prints
//! `committed <key> <outcome>`, then waits to be killed before it could acknowledge. `run`:
//! consumes until it is killed, or until SIGTERM, and then prints `processed <n> duplicates
//! <n>` as it counted them; a reader also prints `took <key>` as it runs its first entry (a
//! Kafka member: once the group assigned it partitions). `run-batched`: the same in batches
//! of 20, without `took`; a reader runs two at once. The work stops at its `hang` failpoint
//! in this process. `run-pausing`: `run`, one delivery at a time, and on SIGUSR1 it takes
//! the next delivery, prints `paused <key>` and stops itself with SIGSTOP before it runs it:
//! resumed past the broker's wait, it runs a delivery the broker gave to another consumer
//! (or group member) meanwhile.
//! `run-<n>-attempts`: `run`, with `n` attempts, where a message whose work ended its
//! consumer that often is dead-lettered before it runs; the work ends this process on a key
//! that starts with `exit`. `run-batched-<n>-attempts`: the same in batches of 20.
//! `run-quorum` (RabbitMQ): `run-3-attempts`, on a quorum queue with a prefetch of 1.
//! `quorum` after the mode (RabbitMQ): the queue is a quorum queue, in any mode.
//! `ack-before-commit` (a consumer, not a reader or a member): deliberately broken, for the
//! fault harness's own test: acknowledges each delivery, then runs its work, so that a kill
//! in between loses it. `separate-claim` (a reader): deliberately broken the other way:
//! commits each entry's effect unless its key is claimed, then claims the key and stores
//! the position in a second transaction, so that a kill in between doubles the effect.
//! `auto-commit` (Kafka): deliberately broken as Kafka's clients are by default: the
//! broker's auto-commit commits each record's offset as it is taken, an assigned partition
//! starts at the offset committed there, and taken records wait in memory for the
//! database, so that a kill loses them.

use justonce_sql::{Inbox, InboxOptions, Key, Outcome};
use justonce_tests::{
    KAFKA_SESSION_TIMEOUT, TestBackend, consumer_work, effect_unless_claimed, mqtt_options,
    shared_mqtt_options,
};
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions, QueueType};
use justonce_transport::kafka::{KafkaOptions, KafkaReader};
use justonce_transport::mqtt::MqttConsumer;
use justonce_transport::nats::{NatsConsumer, NatsOptions, NatsReader};
use justonce_transport::redis_streams::{
    RedisStreamConsumer, RedisStreamOptions, RedisStreamReader,
};
use justonce_transport::{
    Broker, Consumer, ConsumerStats, KeyFrom, OrderedBroker, Policy, Ran, Reader,
};
use justonce_transport::{Incoming, Work};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Headers, Message};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (quorum, args) = match args.as_slice() {
        [args @ .., last] if last == "quorum" => (true, args),
        args => (false, args),
    };
    let [url, prefix, broker, queue, kind, mode] = args else {
        eprintln!(
            "usage: broker-worker <database-url> <prefix> <broker-url> <queue> <kind> <mode> [quorum]"
        );
        return ExitCode::from(2);
    };
    let result = justonce_tests::with_backend!(url, DB => work::<DB>(url, prefix, broker, queue, kind, mode, quorum).await);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("broker-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn work<DB: TestBackend>(
    url: &str,
    prefix: &str,
    broker: &str,
    queue: &str,
    kind: &str,
    mode: &str,
    quorum: bool,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    justonce_tests::hang_at_failpoints();
    let reader = kind == "reader";
    let attempts = match mode.strip_suffix("-attempts") {
        Some(run) => run.rsplit('-').next().and_then(|n| n.parse().ok()),
        None => (mode == "run-quorum").then_some(3),
    }
    .unwrap_or(Policy::default().max_attempts);
    let inbox = Inbox::<DB>::connect_with(
        url,
        justonce_sql::Consumer::new("test")?,
        InboxOptions::default().prefix(prefix),
    )
    .await?;
    if broker.starts_with("mqtt:") {
        let options = match kind.strip_prefix("member-") {
            Some(member) => shared_mqtt_options(queue, member),
            None => mqtt_options(queue),
        }
        .max_attempts(attempts)
        .dead_letter_topic(format!("{queue}/dead"));
        let consumer = MqttConsumer::connect(broker, inbox.clone(), options).await?;
        consume(&consumer, prefix, mode).await
    } else if broker.starts_with("kafka:") {
        if mode == "auto-commit" {
            return auto_commit(broker, &inbox, prefix, queue).await;
        }
        let options = KafkaOptions::new(queue, queue)
            .key_from(KeyFrom::Header(KAFKA_ID_HEADER.into()))
            .session_timeout(KAFKA_SESSION_TIMEOUT)
            .max_attempts(attempts);
        read(KafkaReader::connect(broker, inbox, options)?, prefix, mode).await
    } else if broker.starts_with("redis:") && reader {
        let options = RedisStreamOptions::new(queue, "test").max_attempts(attempts);
        read(
            RedisStreamReader::connect(broker, inbox, options).await?,
            prefix,
            mode,
        )
        .await
    } else if broker.starts_with("redis:") {
        let options = RedisStreamOptions::new(queue, "test")
            .consumer(format!("worker-{}", std::process::id()))
            .claim_idle(std::time::Duration::from_millis(500))
            .max_attempts(attempts);
        let consumer = RedisStreamConsumer::connect(broker, inbox.clone(), options).await?;
        consume(&consumer, prefix, mode).await
    } else if broker.starts_with("nats:") && reader {
        let options = NatsOptions::new(queue, queue)
            .key_from(KeyFrom::Header("Order-Id".into()))
            .max_attempts(attempts);
        read(
            NatsReader::connect(broker, inbox, options).await?,
            prefix,
            mode,
        )
        .await
    } else if broker.starts_with("nats:") {
        let options = NatsOptions::new(queue, queue)
            .key_from(KeyFrom::Header("Order-Id".into()))
            .max_attempts(attempts);
        let consumer = NatsConsumer::connect(broker, inbox.clone(), options).await?;
        consume(&consumer, prefix, mode).await
    } else {
        let options = match mode {
            "run-quorum" => AmqpOptions::new(queue)
                .queue_type(QueueType::Quorum)
                .prefetch(1),
            _ if quorum => AmqpOptions::new(queue).queue_type(QueueType::Quorum),
            _ => AmqpOptions::new(queue),
        }
        .max_attempts(attempts);
        let consumer = AmqpConsumer::connect(broker, inbox.clone(), options).await?;
        consume(&consumer, prefix, mode).await
    }
}

/// What a consumer of any broker does in `mode`.
async fn consume<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    prefix: &str,
    mode: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let work = consumer_work::<DB>(prefix);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let terminated = async move { terminate.recv().await };
    let batch_size = match mode {
        "ack-before-commit" => return ack_before_commit(consumer, prefix).await,
        "run-pausing" => return run_pausing(consumer, prefix, terminated).await,
        _ if mode.starts_with("run-batched") => 20,
        "pause-after-commit" => {
            let mut deliveries = consumer.deliveries().await?;
            let delivery = deliveries
                .next()
                .await?
                .ok_or("the consumer was cancelled")?;
            let key = consumer.incoming(&delivery)?.key;
            let ran = consumer.run_one(&delivery, &work).await;
            return pause_after_commit(key.as_str(), ran).await;
        }
        _ => 1,
    };
    let stats = consumer.run_batched(terminated, batch_size, work).await?;
    print_counts(&stats);
    Ok(())
}

/// `run-pausing`: runs and settles each delivery, and on SIGUSR1 stops the process with
/// SIGSTOP between taking the next delivery and running it (see [`pause_if_asked`]).
/// Prints the counts as `run` does once terminated.
async fn run_pausing<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    prefix: &str,
    terminated: impl std::future::Future,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let work = consumer_work::<DB>(prefix);
    let mut deliveries = consumer.deliveries().await?;
    let stats = pausing(
        terminated,
        async || deliveries.next().await,
        |delivery| consumer.incoming(delivery).map(|incoming| incoming.key),
        async |delivery, stats| {
            let ran = consumer.run_one(delivery, &work).await;
            Ok(consumer.settle(delivery, ran, stats).await?)
        },
    )
    .await?;
    deliveries.stop().await?;
    print_counts(&stats);
    Ok(())
}

/// `run-pausing` for a reader: as [`run_pausing`], one entry at a time, each stored with
/// its offset as it runs.
async fn read_pausing<O: OrderedBroker, DB: TestBackend>(
    reader: &Reader<O, DB>,
    prefix: &str,
    terminated: impl std::future::Future,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let work = consumer_work::<DB>(prefix);
    let mut entries = reader.deliveries().await?;
    let stats = pausing(
        terminated,
        async || entries.next().await,
        |entry| reader.incoming(entry).map(|incoming| incoming.key),
        async |entry, stats| {
            match reader.run_one(entry, &work).await {
                Ran::Outcome(Outcome::Processed(())) => stats.processed += 1,
                Ran::Outcome(_) => stats.duplicates += 1,
                other => return Err(format!("{other:?}").into()),
            }
            Ok(())
        },
    )
    .await?;
    entries.stop().await?;
    print_counts(&stats);
    Ok(())
}

/// The loop of `run-pausing`: takes each delivery with `next` until `terminated` or the
/// end, stops before running it if asked (see [`pause_if_asked`]), and runs it with `run`,
/// which counts it.
async fn pausing<D>(
    terminated: impl std::future::Future,
    mut next: impl AsyncFnMut() -> Result<Option<D>, justonce_transport::Error>,
    key_of: impl Fn(&D) -> Result<Key, String>,
    mut run: impl AsyncFnMut(
        &D,
        &mut ConsumerStats,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>,
) -> Result<ConsumerStats, Box<dyn std::error::Error + Send + Sync>> {
    let pause_asked = pause_on_usr1()?;
    let mut terminated = std::pin::pin!(terminated);
    let mut stats = ConsumerStats::default();
    loop {
        let delivery = tokio::select! {
            _ = &mut terminated => break,
            next = next() => match next? {
                Some(delivery) => delivery,
                None => break,
            },
        };
        pause_if_asked(&pause_asked, &key_of(&delivery)?)?;
        run(&delivery, &mut stats).await?;
    }
    Ok(stats)
}

/// Notes each SIGUSR1 aside, so that the wait for a delivery is never cancelled for it.
fn pause_on_usr1() -> Result<Arc<AtomicBool>, std::io::Error> {
    let mut asked = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())?;
    let pause_asked = Arc::new(AtomicBool::new(false));
    let noting = Arc::clone(&pause_asked);
    tokio::spawn(async move {
        while asked.recv().await.is_some() {
            noting.store(true, Ordering::Relaxed);
        }
    });
    Ok(pause_asked)
}

/// If a pause was asked, prints `paused <key>` and stops the process with SIGSTOP, holding
/// the delivery of `key` with nothing of it committed: no lock in the database, so that
/// another consumer can take the delivery over and commit it. Resumed past the broker's
/// wait, the caller runs a delivery the broker gave to another meanwhile.
fn pause_if_asked(
    pause_asked: &AtomicBool,
    key: &Key,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if pause_asked.swap(false, Ordering::Relaxed) {
        let mut stdout = std::io::stdout();
        writeln!(stdout, "paused {key}")?;
        stdout.flush()?;
        // Blocks until SIGCONT: the stop is certain to come before the delivery runs.
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &std::process::id().to_string()])
            .status()?;
        if !stopped.success() {
            return Err("cannot stop this process with SIGSTOP".into());
        }
    }
    Ok(())
}

/// What `run` prints once terminated, for the harness to sum.
fn print_counts(stats: &ConsumerStats) {
    println!(
        "processed {} duplicates {}",
        stats.processed, stats.duplicates
    );
}

/// What a single reader of any broker does in `mode`.
async fn read<O: OrderedBroker, DB: TestBackend>(
    reader: Reader<O, DB>,
    prefix: &str,
    mode: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let work = consumer_work::<DB>(prefix);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let terminated = async move { terminate.recv().await };
    match mode {
        "run-pausing" => read_pausing(&reader, prefix, terminated).await,
        "separate-claim" => {
            let mut entries = reader.deliveries().await?;
            while let Some(entry) = entries.next().await? {
                let key = reader.incoming(&entry)?.key;
                effect_unless_claimed(reader.inbox(), prefix, key.as_str()).await?;
                tokio::time::sleep(BROKEN_GAP).await;
                settled(reader.run_one(&entry, &nothing::<DB>).await)?;
            }
            Ok(())
        }
        "pause-after-commit" => {
            let mut entries = reader.deliveries().await?;
            let entry = entries.next().await?.ok_or("the stream ended")?;
            let key = reader.incoming(&entry)?.key;
            let ran = reader.run_one(&entry, &work).await;
            pause_after_commit(key.as_str(), ran).await
        }
        _ => {
            let batched = mode.starts_with("run-batched");
            let batch_size = if batched { 20 } else { 1 };
            let reader = reader.batches_at_once(if batched { 2 } else { 1 });
            // In batches the first line a test waits for is the failpoint's: nothing to tell.
            let said = AtomicBool::new(batched);
            let stats = (reader)
                .run_batched(terminated, batch_size, telling_first(&work, &said))
                .await?;
            print_counts(&stats);
            Ok(())
        }
    }
}

/// `work`, printing `took <key>` before the first entry's: a group member says so once the
/// group assigned it partitions and it consumes them.
fn telling_first<'w, DB: TestBackend>(
    work: &'w (impl Work<DB, sqlx::Error> + 'w),
    said: &'w AtomicBool,
) -> impl for<'e, 't> Fn(
    &'t mut sqlx::Transaction<'e, DB>,
    &'t Incoming,
) -> justonce_sql::WorkFuture<'t, (), sqlx::Error>
+ Sync
+ 'w {
    move |tx, message| {
        if !said.swap(true, Ordering::Relaxed) {
            println!("took {}", message.key.as_str());
        }
        work(tx, message)
    }
}

/// The header a Kafka record carries its key in, as CloudEvents' binary mode does.
const KAFKA_ID_HEADER: &str = "ce_id";

/// Deliberately broken, for the fault harness's own test: a group member that keeps its
/// offsets the way Kafka's clients do by default. The broker's auto-commit commits the
/// offset of each record taken, every few milliseconds, and an assigned partition starts at
/// the offset committed there; records taken wait in memory until the database commits
/// their key and effect. A kill loses those waiting.
async fn auto_commit<DB: TestBackend>(
    broker: &str,
    inbox: &Inbox<DB>,
    prefix: &str,
    topic: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.trim_start_matches("kafka://"))
        .set("group.id", topic)
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "10")
        .set("auto.offset.reset", "earliest")
        .set(
            "session.timeout.ms",
            KAFKA_SESSION_TIMEOUT.as_millis().to_string(),
        )
        .set(
            "heartbeat.interval.ms",
            (KAFKA_SESSION_TIMEOUT / 3).as_millis().to_string(),
        )
        .create()?;
    consumer.subscribe(&[topic])?;
    let (queue, mut taken) = tokio::sync::mpsc::channel::<String>(256);
    let working = async {
        let said = AtomicBool::new(false);
        while let Some(key) = taken.recv().await {
            if !said.swap(true, Ordering::Relaxed) {
                println!("took {key}");
            }
            effect_after_ack(inbox, prefix, &key).await?;
        }
        Ok(())
    };
    tokio::try_join!(take_records(&consumer, queue), working).map(drop)
}

/// Takes each record's key into `queue`; the broker counts the record consumed at once.
async fn take_records(
    consumer: &StreamConsumer,
    queue: tokio::sync::mpsc::Sender<String>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    loop {
        let record = consumer.recv().await?;
        let key = (record.headers().into_iter())
            .flat_map(|headers| headers.iter())
            .find(|header| header.key == KAFKA_ID_HEADER)
            .and_then(|header| header.value)
            .map(|value| String::from_utf8_lossy(value).into_owned())
            .ok_or("a record without its key")?;
        queue.send(key).await?;
    }
}

/// Acknowledges each delivery first, then claims its key and writes its effect: the
/// broken order the fault harness must catch.
async fn ack_before_commit<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    prefix: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut deliveries = consumer.deliveries().await?;
    let mut stats = ConsumerStats::default();
    while let Some(delivery) = deliveries.next().await? {
        let key = consumer.incoming(&delivery)?.key;
        consumer
            .settle(&delivery, acknowledged(), &mut stats)
            .await?;
        tokio::time::sleep(BROKEN_GAP).await;
        effect_after_ack(consumer.inbox(), prefix, key.as_str()).await?;
    }
    Ok(())
}

/// What `ack-before-commit` settles a delivery with before its work has run.
fn acknowledged() -> Ran<sqlx::Error> {
    Ran::Outcome(Outcome::Processed(()))
}

/// Claims `key` and writes its effect, after its delivery was acknowledged.
async fn effect_after_ack<DB: TestBackend>(
    inbox: &Inbox<DB>,
    prefix: &str,
    key: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let key = Key::new(key)?;
    // Processed or a duplicate: acknowledged either way, before.
    let _ = inbox
        .run(&key, key.as_str().as_bytes(), |tx| {
            let (prefix, key) = (prefix.to_owned(), key.as_str().to_owned());
            Box::pin(async move { DB::insert_effect(tx, &prefix, "test", &key).await })
        })
        .await?;
    Ok(())
}

/// How long a broken mode waits inside its broken window: `separate-claim` between its two
/// transactions, `ack-before-commit` between the acknowledgement and the effect (which
/// also gives a client that sends acknowledgements from its own loop, as MQTT's does, time
/// to send it). Without it ten random kills sometimes all missed the window: the check of
/// the broken mode rested on luck.
const BROKEN_GAP: std::time::Duration = std::time::Duration::from_millis(2);

/// The work of `separate-claim`'s second transaction: none, its effect already committed.
fn nothing<'t, DB: TestBackend>(
    _tx: &'t mut justonce_sql::sqlx::Transaction<'_, DB>,
    _message: &'t justonce_transport::Incoming,
) -> justonce_sql::WorkFuture<'t, (), justonce_sql::sqlx::Error> {
    Box::pin(async { Ok(()) })
}

/// Fails on a run that neither committed nor found the key held.
fn settled(
    ran: Ran<justonce_sql::sqlx::Error>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match ran {
        Ran::Outcome(_) => Ok(()),
        other => Err(format!("{other:?}").into()),
    }
}

/// Says that the work of `key` committed, then waits to be killed: the message is never
/// acknowledged.
async fn pause_after_commit<E: std::fmt::Debug>(
    key: &str,
    ran: Ran<E>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let Ran::Outcome(outcome) = ran else {
        return Err(format!("the work did not commit: {ran:?}").into());
    };
    let mut stdout = std::io::stdout();
    writeln!(stdout, "committed {key} {outcome:?}")?;
    stdout.flush()?;
    std::future::pending().await
}
