//! The brokers themselves fail, and a consumer pauses.
//!
//! `broker-restart`: a broker of the harness's own ([`OwnBroker`]) is SIGKILLed and started
//! again under load, while a publisher publishes with confirms and publishes again what the
//! broker did not confirm, and a `broker-worker` consumes. Nothing confirmed may be lost and
//! nothing doubled. The consumer connects again by itself; one that exits all the same is
//! started again and counted, and the tests expect none. The recovery is the time from the
//! kill to the first effect committed after the broker is back.
//!
//! `pause`: two `broker-worker`s share a queue on the machine's broker; one stops itself
//! with SIGSTOP at its failpoint, holding a delivery it took and has not run, for three
//! times the broker's wait before it gives an unacknowledged delivery to another consumer,
//! then is resumed with SIGCONT. What it held is processed by the other, and its late
//! commits are duplicates. The recovery is from the pause to the other's next effect; the
//! details say when the other committed the delivery held.

use crate::broker::{key_index, key_name};
use crate::kafka_group::KafkaTopic;
use crate::real_broker::{
    AmqpQueue, Consumer, MqttTopic, NatsStream, RealQueue, RedisStream, STALLED,
};
use crate::report::{Report, latency_details};
use crate::{Args, Rng};
use justonce_tests::{OwnBroker, StoreFile};
use justonce_tests::{TestBackend, TestDb};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// `broker-restart` on the broker of `--broker`.
pub async fn broker_restart<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    match args.broker.as_str() {
        "amqp" => restart::<DB, AmqpQueue>(args, db, rng, title).await,
        "nats" => restart::<DB, NatsStream>(args, db, rng, title).await,
        "redis" => restart::<DB, RedisStream>(args, db, rng, title).await,
        "mqtt" => restart::<DB, MqttTopic>(args, db, rng, title).await,
        other => Err(format!(
            "broker-restart runs on amqp, nats, redis or mqtt, not {other}"
        )),
    }
}

/// `pause` on the broker of `--broker`.
pub async fn pause<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    match args.broker.as_str() {
        "nats" => pause_consumer::<DB, NatsStream>(args, db, rng, title).await,
        "redis" => pause_consumer::<DB, RedisStream>(args, db, rng, title).await,
        "kafka" => pause_consumer::<DB, KafkaTopic>(args, db, rng, title).await,
        other => Err(format!(
            "pause runs on nats, redis or kafka, not {other}: RabbitMQ and Mosquitto give a \
             paused consumer's deliveries to another only once its connection is closed"
        )),
    }
}

/// Effect counts in `[keys / 10, keys * 8 / 10)`, sorted: where the faults come, well inside
/// the run.
fn fault_points(rng: &mut Rng, keys: usize, faults: usize) -> Vec<i64> {
    let mut points: Vec<i64> = (0..faults)
        .map(|_| (keys / 10 + rng.below(keys as u64 * 7 / 10) as usize) as i64)
        .collect();
    points.sort_unstable();
    points
}

/// Publishes `keys` distinct keys, a tenth of them twice, to a queue on a broker of the
/// harness's own, which it kills and starts again at random points while `broker-worker`
/// consumes; then compares what the broker confirmed with the effect rows.
async fn restart<DB: TestBackend, Q: RealQueue>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let keys = args.size(1_000, 10_000);
    let restarts = args.size(2, 5);
    let deadline = Instant::now() + Duration::from_secs(args.size(240, 1200) as u64);
    let mut plan: Vec<u32> = (0..keys as u32).chain(0..keys as u32 / 10).collect();
    rng.shuffle(&mut plan);
    let points = fault_points(rng, keys, restarts);
    let mut server = OwnBroker::start(&args.broker).await?;
    let mut queue = Q::open(db, &server.url()).await?;
    let mut consumer = Consumer::of(db, &queue, args.run_mode());
    let checked = async {
        let published = AtomicUsize::new(0);
        let saved = server.saved_after_confirm();
        let publishing =
            publish_confirmed(&mut queue, db, &plan, &published, saved.as_ref(), deadline);
        let restarting = async {
            consumer.start()?;
            let mut faults = Faults::default();
            let mut unrecovered: Option<Unrecovered> = None;
            for point in points {
                loop {
                    if Instant::now() >= deadline {
                        return Err(format!("the run reached {point} effects too late"));
                    }
                    let committed = db.rows("effects").await;
                    faults
                        .watch(&mut consumer, &mut unrecovered, committed)
                        .await?;
                    if committed >= point && unrecovered.is_none() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
                let began = Instant::now();
                server.kill().await?;
                faults.count += 1;
                tokio::time::sleep(Duration::from_millis(100 + rng.below(900))).await;
                server.start_again().await?;
                unrecovered = Some(Unrecovered {
                    began,
                    back: Instant::now(),
                    effects: db.rows("effects").await,
                });
            }
            while unrecovered.is_some() {
                if Instant::now() >= deadline {
                    return Err("no effect was committed after the last restart".to_owned());
                }
                let committed = db.rows("effects").await;
                faults
                    .watch(&mut consumer, &mut unrecovered, committed)
                    .await?;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok::<_, String>(faults)
        };
        let ((sent, republished), mut faults) = tokio::try_join!(publishing, restarting)?;
        // The publisher's connection may be to a broker since killed.
        queue.reconnect().await?;
        let drained = drain(
            &queue,
            db,
            std::slice::from_mut(&mut consumer),
            keys,
            deadline,
        )
        .await?;
        faults.consumer_restarts += drained.restarts;
        let mut report = check(title, &queue, db, keys, sent, drained.settled).await?;
        report.faults = faults.count;
        report.recovery = faults.recovery;
        if faults.hung > 0 {
            report.breaches.push(format!(
                "{} time(s) the consumer neither consumed nor exited for {} s after its broker \
                 came back: killed and started again",
                faults.hung,
                HUNG.as_secs()
            ));
        }
        report.details = vec![
            (
                "messages published again, unconfirmed when the broker went".to_owned(),
                republished,
            ),
            (
                "consumer processes started again after exiting".to_owned(),
                faults.consumer_restarts,
            ),
        ];
        Ok(report)
    }
    .await;
    let stopped = consumer.kill().await;
    drop(consumer);
    // The broker and its folder go, and the queue with them.
    drop(server);
    crate::cleaned_up(checked, stopped)
}

/// What the faults of a run did.
#[derive(Default)]
struct Faults {
    count: usize,
    /// From each fault to the first effect committed after it ended.
    recovery: Vec<Duration>,
    /// How often a consumer exited on its own and was started again.
    consumer_restarts: u64,
    /// How often a consumer hung after its broker came back, and was killed.
    hung: u64,
}

/// A restart not yet recovered from.
struct Unrecovered {
    /// When the kill began.
    began: Instant,
    /// When the broker listened again, or the hung consumer was last killed.
    back: Instant,
    /// The effects then.
    effects: i64,
}

/// How long a consumer may commit nothing after its broker came back before it is taken to
/// hang: far beyond a restart's recovery, and the ack waits of the brokers.
const HUNG: Duration = Duration::from_secs(30);

impl Faults {
    /// Starts the consumer again if it exited, kills it if it hangs, and counts the
    /// recovery once `committed` passes the effects at the broker's return.
    async fn watch<DB: TestBackend>(
        &mut self,
        consumer: &mut Consumer<'_, DB>,
        unrecovered: &mut Option<Unrecovered>,
        committed: i64,
    ) -> Result<(), String> {
        self.consumer_restarts += u64::from(consumer.restart_if_exited()?);
        let Some(restart) = unrecovered else {
            return Ok(());
        };
        if committed > restart.effects {
            self.recovery.push(restart.began.elapsed());
            *unrecovered = None;
        } else if restart.back.elapsed() >= HUNG {
            consumer.kill().await?;
            self.hung += 1;
            restart.back = Instant::now();
        }
        Ok(())
    }
}

/// Publishes the messages of `plan` in chunks, each confirmed by the broker before the
/// next, never more than [`AHEAD`] keys past the effects committed, so that the broker's
/// faults find work in flight; a chunk the broker did not confirm is published again on a
/// new connection until it is. A broker that confirms before it saves (`saved`) has
/// confirmed a chunk once a save follows: a kill before that may lose it, as if it were
/// never confirmed. Returns the messages sent, and those sent again.
async fn publish_confirmed<DB: TestBackend, Q: RealQueue>(
    queue: &mut Q,
    db: &TestDb<DB>,
    plan: &[u32],
    published: &AtomicUsize,
    saved: Option<&StoreFile>,
    deadline: Instant,
) -> Result<(u64, u64), String> {
    let mut seen = vec![false; plan.len()];
    let mut distinct = 0;
    let (mut sent, mut again) = (0, 0);
    for chunk in plan.chunks(50) {
        loop {
            let committed = db.rows("effects").await;
            if distinct <= committed + AHEAD {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the consumer fell behind the publisher: {committed} effects of {distinct} keys confirmed"
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let messages: Vec<String> = chunk.iter().map(|key| key_name(*key)).collect();
        loop {
            sent += messages.len() as u64;
            let publishing = saved.map(StoreFile::publishing);
            let confirmed = tokio::time::timeout(CONFIRM_WAIT, queue.publish(&messages)).await;
            let unconfirmed = match (confirmed, saved.zip(publishing)) {
                (Ok(Ok(())), None) => break,
                (Ok(Ok(())), Some((store, publishing))) => {
                    if store.saved_again(publishing, CONFIRM_WAIT).await {
                        break;
                    }
                    "confirmed, and not saved by the broker that confirmed it".to_owned()
                }
                (Ok(Err(error)), _) => error,
                (Err(_), _) => format!("no confirm within {} s", CONFIRM_WAIT.as_secs()),
            };
            again += messages.len() as u64;
            // Refused while the broker is down: tried again until it is back.
            loop {
                if Instant::now() >= deadline {
                    return Err(format!("the broker did not confirm in time: {unconfirmed}"));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                if queue.reconnect().await.is_ok() {
                    break;
                }
            }
        }
        for key in chunk {
            let seen = &mut seen[*key as usize];
            distinct += i64::from(!std::mem::replace(seen, true));
        }
        published.fetch_add(chunk.len(), Ordering::Relaxed);
    }
    Ok((sent, again))
}

/// How far the publisher runs ahead of the effects, in keys.
const AHEAD: i64 = 300;

/// How long a chunk's confirms may take before it is published again.
const CONFIRM_WAIT: Duration = Duration::from_secs(5);

/// How a drain ended.
struct Drained {
    /// Whether the broker holds nothing unacknowledged.
    settled: bool,
    /// Consumers that exited on their own and were started again.
    restarts: u64,
    /// Each consumer's counts, summed over the stops at which it printed them: acknowledged
    /// as processed and as duplicates; `None` for one that never stopped cleanly.
    counts: Vec<Option<(u64, u64)>>,
}

/// Runs `consumers` until nothing waits in `queue` and every key has its effect (or none
/// has come for [`STALLED`]), stops them with SIGTERM and asks the broker whether anything is
/// left unacknowledged; starts them again if it is.
async fn drain<DB: TestBackend, Q: RealQueue>(
    queue: &Q,
    db: &TestDb<DB>,
    consumers: &mut [Consumer<'_, DB>],
    keys: usize,
    deadline: Instant,
) -> Result<Drained, String> {
    let mut drained = Drained {
        settled: false,
        restarts: 0,
        counts: vec![None; consumers.len()],
    };
    let mut last_effect = (db.rows("effects").await, Instant::now());
    let mut quiet_since: Option<Instant> = None;
    while Instant::now() < deadline {
        for consumer in consumers.iter_mut() {
            drained.restarts += u64::from(consumer.restart_if_exited()?);
        }
        let committed = db.rows("effects").await;
        if committed != last_effect.0 {
            last_effect = (committed, Instant::now());
        }
        let done = queue.nothing_waiting(db).await? != Some(false)
            && (committed as usize >= keys || last_effect.1.elapsed() >= STALLED);
        if !done {
            quiet_since = None;
        } else if quiet_since.get_or_insert_with(Instant::now).elapsed()
            >= Duration::from_millis(300)
        {
            for (consumer, counts) in consumers.iter_mut().zip(&mut drained.counts) {
                // Summed over the processes that ran in the consumer's place.
                if let Ok((processed, duplicates)) = consumer.terminate().await {
                    let (all_processed, all_duplicates) = counts.get_or_insert((0, 0));
                    (*all_processed, *all_duplicates) =
                        (*all_processed + processed, *all_duplicates + duplicates);
                }
            }
            if queue.settled(db).await? {
                drained.settled = true;
                break;
            }
            for consumer in consumers.iter_mut() {
                consumer.start()?;
            }
            quiet_since = None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(drained)
}

/// Compares what `queue` still holds and the effect rows with `keys` keys, each confirmed
/// by the broker.
async fn check<DB: TestBackend, Q: RealQueue>(
    title: String,
    queue: &Q,
    db: &TestDb<DB>,
    keys: usize,
    sent: u64,
    drained: bool,
) -> Result<Report, String> {
    // Counted before the harness takes anything itself.
    let redeliveries = queue.redeliveries().await?;
    let mut acknowledged = vec![true; keys];
    for key in queue.take_unacknowledged(db).await? {
        let index = key_index(&key).ok_or_else(|| format!("the queue held key {key:?}"))?;
        acknowledged[index as usize] = false;
    }
    let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
        .await
        .map_err(|e| format!("cannot read the effect rows: {e}"))?;
    let mut report = Report::compare(
        title,
        sent as usize,
        &vec![true; keys],
        &acknowledged,
        effects,
    );
    report.redeliveries = redeliveries;
    report.drained = drained;
    Ok(report)
}

/// Publishes `keys` distinct keys to a queue of the run's own on the machine's broker, read
/// by two consumers, one of which stops itself with SIGSTOP at its failpoint (a delivery
/// taken, nothing of it committed) and is resumed past the broker's wait; then compares the
/// broker's account with the effect rows.
async fn pause_consumer<DB: TestBackend, Q: RealQueue>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let taken_over_after = Q::TAKEN_OVER_AFTER.ok_or("the broker never takes deliveries over")?;
    let paused_for = 3 * taken_over_after;
    let keys = args.size(1_000, 10_000);
    let pauses = args.size(2, 10);
    let deadline = Instant::now() + Duration::from_secs(args.size(120, 900) as u64);
    // Each key once: a duplicate is a delivery made again.
    let mut plan: Vec<u32> = (0..keys as u32).collect();
    rng.shuffle(&mut plan);
    let queue = Q::open(db, &Q::shared_url()).await?;
    let mut consumers = [
        Consumer::of(db, &queue, "run-pausing"),
        Consumer::of(db, &queue, "run"),
    ];
    let checked = async {
        let messages: Vec<String> = plan.iter().map(|key| key_name(*key)).collect();
        let mut unpublished = Unpublished {
            messages: &messages,
            published: 0,
        };
        // A part of the keys per pause, published just before it is asked for, so that
        // the consumer asked always has deliveries left to take: had the other consumer
        // read everything while the last pause lasted, it would never take one to pause on.
        // A quarter is kept for while it comes back (see `TRICKLE`).
        let part = (keys - keys / 4) / (pauses + 1);
        let mut part_start = 0;
        unpublished.publish(&queue, part).await?;
        for consumer in &mut consumers {
            consumer.start()?;
        }
        let mut faults = 0;
        let mut recovery = Vec::new();
        let mut takeovers = Vec::new();
        for _ in 0..pauses {
            // Within the last part published, past its first tenth.
            let point = (part_start + part / 10 + rng.below(part as u64 * 7 / 10) as usize) as i64;
            while db.rows("effects").await < point {
                if Instant::now() >= deadline {
                    return Err(format!("the run reached {point} effects too late"));
                }
                for consumer in &mut consumers {
                    if consumer.restart_if_exited()? {
                        return Err("a consumer exited on its own".to_owned());
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            part_start = unpublished.published;
            unpublished.publish(&queue, part).await?;
            consumers[0].catching_usr1(deadline).await?;
            consumers[0].signal("USR1").await?;
            let held = {
                let paused = consumers[0].paused(deadline);
                tokio::pin!(paused);
                loop {
                    tokio::select! {
                        held = &mut paused => break held?,
                        () = tokio::time::sleep(TRICKLE_EVERY) => {}
                    }
                    // The other read all there was: a Kafka member resumed takes nothing
                    // until the rebalance after it rejoined gives it partitions. A few keys
                    // at a time, until the one asked takes one.
                    if db.rows("effects").await >= unpublished.published as i64
                        && unpublished.publish(&queue, TRICKLE).await? == 0
                    {
                        return Err(
                            "the keys ran out before the consumer asked took one".to_owned()
                        );
                    }
                }
            };
            let held = justonce_sql::Key::new(held).map_err(|e| e.to_string())?;
            let began = Instant::now();
            faults += 1;
            // The other consumer carries on: recovered at its first effect. The pause lasts
            // until the other committed the delivery held, so that the paused one's late
            // run of it is certain to be a duplicate.
            let before = db.rows("effects").await;
            while began.elapsed() < paused_for || takeovers.len() < faults {
                if Instant::now() >= deadline {
                    return Err(format!("no other consumer took over {held} in time"));
                }
                if recovery.len() < faults && db.rows("effects").await > before {
                    recovery.push(began.elapsed());
                }
                if takeovers.len() < faults && db.effects_of(&held).await > 0 {
                    takeovers.push(began.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            consumers[0].signal("CONT").await?;
        }
        unpublished.publish(&queue, keys).await?;
        let drained = drain(&queue, db, &mut consumers, keys, deadline).await?;
        let mut report = check(title, &queue, db, keys, keys as u64, drained.settled).await?;
        report.faults = faults;
        report.recovery = recovery;
        let counted = |consumer: usize, duplicates: bool| {
            drained.counts[consumer].map(
                |(processed, duplicate)| {
                    if duplicates { duplicate } else { processed }
                },
            )
        };
        let mut details = vec![
            ("each pause (ms)".to_owned(), paused_for.as_millis() as u64),
            (
                "consumer processes started again after exiting".to_owned(),
                drained.restarts,
            ),
        ];
        for (name, consumer, duplicates) in [
            ("paused consumer: acknowledged as processed", 0, false),
            ("paused consumer: acknowledged as duplicates", 0, true),
            ("other consumer: acknowledged as processed", 1, false),
            ("other consumer: acknowledged as duplicates", 1, true),
        ] {
            if let Some(count) = counted(consumer, duplicates) {
                details.push((name.to_owned(), count));
            }
        }
        details.extend(latency_details(
            "held delivery committed by the other",
            &takeovers,
        ));
        report.details = details;
        Ok(report)
    }
    .await;
    let mut stopped = Ok(());
    for consumer in &mut consumers {
        stopped = stopped.and(consumer.kill().await);
    }
    drop(consumers);
    let deleted = queue
        .delete()
        .await
        .map_err(|e| format!("cannot delete the queue: {e}"));
    crate::cleaned_up(crate::cleaned_up(checked, stopped), deleted)
}

/// While a pause is asked for and not yet taken, and the other consumer read all there
/// was, this many keys more every [`TRICKLE_EVERY`].
const TRICKLE: usize = 5;
const TRICKLE_EVERY: Duration = Duration::from_secs(1);

/// The messages of a run published in order, part by part.
struct Unpublished<'m> {
    messages: &'m [String],
    published: usize,
}

impl Unpublished<'_> {
    /// Publishes the next `count` messages, or those left; how many it published.
    async fn publish<Q: RealQueue>(&mut self, queue: &Q, count: usize) -> Result<usize, String> {
        let next = &self.messages[self.published..];
        let next = &next[..count.min(next.len())];
        if !next.is_empty() {
            queue.publish(next).await?;
            self.published += next.len();
        }
        Ok(next.len())
    }
}
