//! NATS JetStream on a cluster of the test's own: a stream of three replicas on three
//! servers, consumed while the server that leads the stream is killed with SIGKILL and
//! started again. Every message takes effect once.

use async_nats::jetstream::{self, consumer::pull};
use justonce_tests::nats_cluster::NatsCluster;
use justonce_tests::{TestDb, consumer_work};
use justonce_transport::nats::{MSG_ID_HEADER, NatsConsumer, NatsOptions};
use justonce_transport::{ConsumerStats, KeyFrom};
use sqlx::Postgres;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Messages published; every fifth repeats the key of the one four before it.
const MESSAGES: usize = 3_000;
/// How many are published before the leader is killed.
const KILLED_AFTER: usize = 1_000;
/// How far publishing may run ahead of the effects, so that the kill finds both under way.
const AHEAD: i64 = 200;
/// How long the killed server stays down.
const DOWN: Duration = Duration::from_secs(3);
/// How long the whole run may take, election and redeliveries included.
const DEADLINE: Duration = Duration::from_secs(180);

/// The key of message `n`.
fn key_of(n: usize) -> String {
    let first = if n % 5 == 4 { n - 4 } else { n };
    format!("order:{first}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_three_replicas_takes_effect_once_when_its_leader_is_killed() {
    let mut cluster = NatsCluster::start(3).await.unwrap();
    let db = TestDb::<Postgres>::new("nats_cluster").await;
    let name = format!("{}orders", db.prefix);
    let options = NatsOptions::new(&name, &name)
        .replicas(3)
        .key_from(KeyFrom::Header("Order-Id".into()))
        // What the killed server had sent and not yet seen acknowledged comes back soon.
        .ack_wait(Duration::from_secs(5))
        .reconnect_max_wait(Duration::from_millis(500));
    let consumer = NatsConsumer::connect(&cluster.url(), db.inbox.clone(), options)
        .await
        .unwrap();
    let url = cluster.url();
    let servers: Vec<&str> = url.split(',').collect();
    let client = async_nats::connect(servers.as_slice()).await.unwrap();
    let jetstream = jetstream::new(client);
    let replicas = jetstream.get_stream(&name).await.unwrap();
    assert_eq!(replicas.cached_info().config.num_replicas, 3);
    let dead = jetstream.get_stream(format!("{name}_DEAD")).await.unwrap();
    assert_eq!(dead.cached_info().config.num_replicas, 3);
    let distinct = (0..MESSAGES).filter(|n| n % 5 != 4).count();

    let published = AtomicUsize::new(0);
    let publish = async {
        let mut retries = 0;
        for n in 0..MESSAGES {
            if n % 20 == 0 {
                // The distinct keys among the first n messages.
                while (n - n / 5) as i64 > db.rows("effects").await + AHEAD {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            retries += publish_until_stored(&jetstream, &name, n).await;
            published.store(n + 1, Ordering::Relaxed);
        }
        retries
    };
    let kill = async {
        while published.load(Ordering::Relaxed) < KILLED_AFTER {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let leader = cluster.stream_leader(&jetstream, &name).await.unwrap();
        let consumer_leader = consumer_leader(&jetstream, &name).await;
        let effects_before = db.rows("effects").await;
        let killed = Instant::now();
        cluster.kill(leader).await.unwrap();
        let stall = tokio::join!(longest_stall(&db, killed, distinct), async {
            tokio::time::sleep(DOWN).await;
            cluster.restart(leader).await.unwrap();
        })
        .0;
        println!(
            "killed the stream leader {} (the consumer's leader: {consumer_leader}) with {} \
             effects written; the consumer wrote none for {:?} after the kill",
            NatsCluster::name(leader),
            effects_before,
            stall
        );
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let work = consumer_work::<Postgres>(&db.prefix);
    let mut run = std::pin::pin!(consumer.run(stopped, work));
    let driver = async {
        let (retries, ()) = tokio::join!(publish, kill);
        let started = Instant::now();
        let done = tokio::time::timeout(DEADLINE, async {
            while !(db.rows("effects").await == distinct as i64
                && unsettled(&jetstream, &name).await == Some(0))
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        let _ = stop.send(());
        (retries, done.is_ok(), started.elapsed())
    };
    let (retries, done, waited) = tokio::select! {
        ended = &mut run => panic!("the consumer ended before the test did: {ended:?}"),
        finished = driver => finished,
    };
    let stats: ConsumerStats = run.await.unwrap();
    println!(
        "{MESSAGES} messages, {retries} publishes retried; after the last publish the \
         consumer settled in {waited:?}: {stats:?}"
    );
    assert!(
        done,
        "{} effect rows of {distinct} keys, and unsettled messages, {DEADLINE:?} after the last \
         publish",
        db.rows("effects").await
    );
    assert_eq!(db.rows("effects").await, distinct as i64);
    assert_eq!(db.doubled_effects().await, 0);
    for stream in [format!("{name}_DEAD"), name.clone()] {
        jetstream.delete_stream(&stream).await.unwrap();
    }
    db.cleanup().await;
}

/// Publishes message `n` with its key in `Order-Id` and an id of its own in `Nats-Msg-Id`,
/// until the stream acknowledges it: a publish that fails while the cluster elects a leader
/// is sent again, and its id makes the stream keep one copy. Returns how many were retried.
async fn publish_until_stored(jetstream: &jetstream::Context, subject: &str, n: usize) -> usize {
    let key = key_of(n);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(MSG_ID_HEADER, format!("publish:{n}").as_str());
    headers.insert("Order-Id", key.as_str());
    let given_up = Instant::now() + Duration::from_secs(60);
    let mut retries = 0;
    loop {
        let payload = key.clone().into_bytes().into();
        let stored = match (jetstream)
            .publish_with_headers(subject.to_owned(), headers.clone(), payload)
            .await
        {
            Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        };
        match stored {
            Ok(()) => return retries,
            Err(error) if Instant::now() >= given_up => {
                panic!("message {n} not stored for 60 s: {error}")
            }
            Err(_) => {
                retries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The server that leads the durable consumer, or why it is not known.
async fn consumer_leader(jetstream: &jetstream::Context, name: &str) -> String {
    let info = async {
        let stream = jetstream.get_stream(name).await.ok()?;
        let mut consumer: jetstream::consumer::Consumer<pull::Config> =
            stream.get_consumer(name).await.ok()?;
        consumer.info().await.ok()?.cluster.clone()?.leader
    };
    info.await.unwrap_or_else(|| "unknown".to_owned())
}

/// Messages of the durable consumer not yet acknowledged; `None` while the cluster does not
/// answer.
async fn unsettled(jetstream: &jetstream::Context, name: &str) -> Option<u64> {
    let stream = jetstream.get_stream(name).await.ok()?;
    let mut consumer: jetstream::consumer::Consumer<pull::Config> =
        stream.get_consumer(name).await.ok()?;
    let info = consumer.info().await.ok()?;
    Some(info.num_pending + info.num_ack_pending as u64)
}

/// The longest time without a new effect row in the 20 s from `killed`, a stall still
/// going at the end included: how long the consumer took to resume.
async fn longest_stall(db: &TestDb<Postgres>, killed: Instant, distinct: usize) -> Duration {
    let mut last = db.rows("effects").await;
    let mut last_change = killed;
    let mut longest = Duration::ZERO;
    while killed.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let rows = db.rows("effects").await;
        if rows != last {
            longest = longest.max(last_change.elapsed());
            last = rows;
            last_change = Instant::now();
        }
    }
    if last < distinct as i64 {
        longest = longest.max(last_change.elapsed());
    }
    longest
}
