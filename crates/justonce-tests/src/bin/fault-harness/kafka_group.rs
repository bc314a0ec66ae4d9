//! `group-kill`: a Kafka consumer group under faults. The workload goes to a topic of the
//! run's own, spread over four partitions, read by two `broker-worker` members of one group,
//! the project's Kafka reader. One member is SIGKILLed at random moments while it consumes;
//! once the group's session timeout has passed, the other takes its partitions, from after
//! the offsets stored in the database; then the killed member is started again, and the
//! group shares the partitions between the two again. A member stores each record's offset
//! in the transaction of its work, so at the end each partition's stored offset must be its
//! last record's.
//!
//! The same topic is the queue of `pause` on Kafka ([`KafkaTopic`]): a member paused past
//! the session timeout loses its partitions to the other.

use crate::broker::{key_index, key_name, sibling};
use crate::real_broker::RealQueue;
use crate::report::{Report, latency_details};
use crate::{Args, Rng};
use justonce_tests::{TestBackend, TestDb};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The partitions of the run's topic.
const PARTITIONS: usize = 4;

/// The header `broker-worker` reads a record's key from.
const ID_HEADER: &str = "ce_id";

/// How long a call to the broker may take, a record's delivery too.
const BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// Records published at once.
const CHUNK: usize = 100;

/// How many records the publisher keeps ahead of what the group has read.
const AHEAD: i64 = 400;

/// How long no effect must come, once every partition is read to its end, before the run
/// ends: a broken member may still work through what it took.
const QUIET: Duration = Duration::from_secs(1);

/// How long no effect may come before the run ends undrained: far beyond a rebalance (the
/// session timeout plus a few seconds), so only a group that stopped making progress, such
/// as broken members that lost what they took, ends this way.
const STALLED: Duration = Duration::from_secs(30);

/// The run's topic, and the clients the harness reads it with.
struct Topic {
    name: String,
    admin: AdminClient<DefaultClientContext>,
    producer: FutureProducer,
    /// Asks for the partitions' ends and, as a client of the members' group that never
    /// joins it, for the offsets committed to the broker.
    client: Arc<BaseConsumer>,
}

fn client_config() -> ClientConfig {
    let url = justonce_tests::kafka_url();
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", url.trim_start_matches("kafka://"));
    config
}

fn kafka_error(error: impl std::fmt::Display) -> String {
    format!("Kafka at {}: {error}", justonce_tests::kafka_url())
}

impl Topic {
    async fn create<DB: TestBackend>(db: &TestDb<DB>) -> Result<Self, String> {
        let name = format!("{}group_topic", db.prefix);
        let admin: AdminClient<DefaultClientContext> =
            client_config().create().map_err(kafka_error)?;
        let new = NewTopic::new(&name, PARTITIONS as i32, TopicReplication::Fixed(1));
        for created in
            (admin.create_topics([&new], &AdminOptions::new()).await).map_err(kafka_error)?
        {
            created.map_err(|(topic, error)| kafka_error(format!("creating {topic}: {error}")))?;
        }
        let producer = client_config()
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", BROKER_TIMEOUT.as_millis().to_string())
            .create()
            .map_err(kafka_error)?;
        let client = client_config()
            .set("group.id", &name)
            .create()
            .map_err(kafka_error)?;
        Ok(Self {
            name,
            admin,
            producer,
            client: Arc::new(client),
        })
    }

    /// One record per key, the key in its `ce_id` header, the partitions taken in turn from
    /// the `first`th; each acknowledged by the broker.
    async fn publish(&self, keys: &[String], first: usize) -> Result<(), String> {
        let mut sent = Vec::with_capacity(keys.len());
        for (n, key) in keys.iter().enumerate() {
            let headers = OwnedHeaders::new().insert(Header {
                key: ID_HEADER,
                value: Some(key.as_str()),
            });
            let record = FutureRecord::<str, str>::to(&self.name)
                .partition(((first + n) % PARTITIONS) as i32)
                .payload(key)
                .headers(headers);
            let delivery =
                (self.producer.send_result(record)).map_err(|(error, _)| kafka_error(error))?;
            sent.push(delivery);
        }
        for delivery in sent {
            (delivery
                .await
                .map_err(|_| kafka_error("the producer went away"))?)
            .map_err(|(error, _)| kafka_error(error))?;
        }
        Ok(())
    }

    /// The offset stored in the database for each partition: the last record the members
    /// processed or found a duplicate there.
    async fn stored<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<[Option<i64>; PARTITIONS], String> {
        let offsets = (db.inbox.load_offsets(&self.name).await)
            .map_err(|e| format!("cannot read the stored offsets: {e}"))?;
        let mut stored = [None; PARTITIONS];
        for (partition, offset) in offsets {
            stored[partition as usize] = Some(offset.position);
        }
        Ok(stored)
    }

    /// Where the group stands in each partition: the next offset it reads there, after the
    /// offset stored in the database, or at the offset committed to the broker, which only a
    /// member relying on the broker's offsets commits.
    async fn positions<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<[i64; PARTITIONS], String> {
        let stored = self.stored(db).await?;
        let (client, topic) = (Arc::clone(&self.client), self.name.clone());
        let committed = tokio::task::spawn_blocking(move || {
            let mut partitions = TopicPartitionList::new();
            for partition in 0..PARTITIONS {
                partitions.add_partition(&topic, partition as i32);
            }
            client
                .committed_offsets(partitions, BROKER_TIMEOUT)
                .map_err(kafka_error)
        })
        .await
        .map_err(|e| e.to_string())??;
        let mut positions = stored.map(|stored| stored.map_or(0, |offset| offset + 1));
        for element in committed.elements() {
            if let Offset::Offset(offset) = element.offset() {
                let position = &mut positions[element.partition() as usize];
                *position = (*position).max(offset);
            }
        }
        Ok(positions)
    }

    /// The keys of the records from `from` to `ends` in each partition, read by a client
    /// assigned the partitions (no group to join).
    async fn keys_between(
        &self,
        from: [i64; PARTITIONS],
        ends: [i64; PARTITIONS],
    ) -> Result<Vec<String>, String> {
        let consumer: StreamConsumer = client_config()
            .set("group.id", format!("{}-check", self.name))
            .create()
            .map_err(kafka_error)?;
        let mut partitions = TopicPartitionList::new();
        let mut left = 0;
        for partition in 0..PARTITIONS {
            if from[partition] < ends[partition] {
                let start = Offset::Offset(from[partition]);
                (partitions.add_partition_offset(&self.name, partition as i32, start))
                    .map_err(kafka_error)?;
                left += ends[partition] - from[partition];
            }
        }
        let mut keys = Vec::new();
        if left == 0 {
            return Ok(keys);
        }
        consumer.assign(&partitions).map_err(kafka_error)?;
        while left > 0 {
            let record = tokio::time::timeout(BROKER_TIMEOUT, consumer.recv())
                .await
                .map_err(|_| format!("{left} records of {} never came", self.name))?
                .map_err(kafka_error)?;
            if record.offset() >= ends[record.partition() as usize] {
                continue;
            }
            let key = (record.headers().into_iter())
                .flat_map(|headers| headers.iter())
                .find(|header| header.key == ID_HEADER)
                .and_then(|header| header.value)
                .map(|key| String::from_utf8_lossy(key).into_owned());
            keys.push(key.unwrap_or_default());
            left -= 1;
        }
        Ok(keys)
    }

    async fn delete(self) -> Result<(), String> {
        for deleted in (self.admin)
            .delete_topics(&[&self.name], &AdminOptions::new())
            .await
            .map_err(kafka_error)?
        {
            deleted.map_err(|(topic, error)| kafka_error(format!("deleting {topic}: {error}")))?;
        }
        Ok(())
    }
}

/// The run's topic as `pause` takes a queue: the group's two members share its
/// partitions, and one paused past the session timeout loses its own to the other.
pub struct KafkaTopic {
    topic: Topic,
    url: String,
    /// The records published, taken in turn by the partitions.
    published: AtomicUsize,
}

impl KafkaTopic {
    /// Where the group stands in each partition, and each partition's end.
    async fn read_to<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<([i64; PARTITIONS], [i64; PARTITIONS]), String> {
        let positions = self.topic.positions(db).await?;
        Ok((positions, ends(self.published.load(Ordering::Relaxed))))
    }
}

impl RealQueue for KafkaTopic {
    /// The group's session timeout: the broker takes a silent member's partitions away
    /// after it, and gives them to the other at the rebalance that follows.
    const TAKEN_OVER_AFTER: Option<Duration> = Some(justonce_tests::KAFKA_SESSION_TIMEOUT);

    /// Every kind of `broker-worker` is a member of the topic's group.
    const KIND: &str = "member";

    fn shared_url() -> String {
        justonce_tests::kafka_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String> {
        Ok(Self {
            topic: Topic::create(db).await?,
            url: url.to_owned(),
            published: AtomicUsize::new(0),
        })
    }

    /// The test broker keeps its data in memory: it is never restarted.
    async fn reconnect(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.topic.name
    }

    async fn publish(&self, keys: &[String]) -> Result<(), String> {
        let first = self.published.fetch_add(keys.len(), Ordering::Relaxed);
        self.topic.publish(keys, first).await
    }

    async fn nothing_waiting<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<Option<bool>, String> {
        let (positions, ends) = self.read_to(db).await?;
        Ok(Some(positions == ends))
    }

    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> Result<bool, String> {
        let (positions, ends) = self.read_to(db).await?;
        Ok(positions == ends)
    }

    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<Vec<String>, String> {
        let (positions, ends) = self.read_to(db).await?;
        self.topic.keys_between(positions, ends).await
    }

    async fn delete(self) -> Result<(), String> {
        self.topic.delete().await
    }
}

/// Each partition's end once the first `published` records of the run are: the partitions
/// are taken in turn, from a topic created empty.
fn ends(published: usize) -> [i64; PARTITIONS] {
    std::array::from_fn(|partition| {
        (published / PARTITIONS + usize::from(partition < published % PARTITIONS)) as i64
    })
}

fn sum(positions: [i64; PARTITIONS]) -> i64 {
    positions.iter().sum()
}

/// A member of the group: a `broker-worker` process, replaced by a new one when it is
/// killed.
struct Member<'a, DB: TestBackend> {
    db: &'a TestDb<DB>,
    topic: &'a str,
    kind: String,
    /// `broker-worker`'s mode: `run`, or the deliberately broken `auto-commit`.
    mode: &'a str,
    running: Option<Child>,
    /// Whether the running process said that it took its first record.
    took: Arc<AtomicBool>,
}

impl<'a, DB: TestBackend> Member<'a, DB> {
    fn new(db: &'a TestDb<DB>, topic: &'a Topic, number: usize, mode: &'a str) -> Self {
        Self {
            db,
            topic: &topic.name,
            kind: format!("member-{number}"),
            mode,
            running: None,
            took: Arc::default(),
        }
    }

    fn start(&mut self) -> Result<(), String> {
        let mut child = Command::new(sibling("broker-worker"))
            .args([
                &self.db.url,
                &self.db.prefix,
                &justonce_tests::kafka_url(),
                self.topic,
                &self.kind,
                self.mode,
            ])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start broker-worker: {e}"))?;
        let stdout = child.stdout.take().ok_or("broker-worker's output")?;
        let took = Arc::new(AtomicBool::new(false));
        self.took = Arc::clone(&took);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("took ") {
                    took.store(true, Ordering::Relaxed);
                }
            }
        });
        self.running = Some(child);
        Ok(())
    }

    /// Whether the running process consumes: it took a record of its partitions.
    fn took(&self) -> bool {
        self.took.load(Ordering::Relaxed)
    }

    /// SIGKILLs the member and waits until it is gone.
    async fn kill(&mut self) -> Result<(), String> {
        if let Some(mut child) = self.running.take() {
            (child.kill().await).map_err(|e| format!("cannot kill the member: {e}"))?;
        }
        Ok(())
    }

    /// An error if the member exited on its own: it failed.
    fn failed(&mut self) -> Result<(), String> {
        if let Some(child) = &mut self.running
            && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
        {
            return Err(format!("{} exited on its own: {status}", self.kind));
        }
        Ok(())
    }
}

/// `group-kill`: publishes the workload, a fifth of its keys twice, kills one member at
/// random points while it consumes, and compares what the group read with the effect rows
/// and each partition's stored offset with its last record.
pub async fn group_kill<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let keys = args.size(8_000, 80_000);
    let kills = args.size(5, 20);
    // A last resort: a group that stops making progress ends at `STALLED`. A correct short
    // run takes about 50 s on a quiet machine, and twice that beside other tests.
    let deadline = Instant::now() + Duration::from_secs(args.size(300, 900) as u64);
    // 10,000 messages for 8,000 keys in the short run.
    let mut plan: Vec<u32> = (0..keys as u32).chain(0..keys as u32 / 4).collect();
    rng.shuffle(&mut plan);
    let mut points: Vec<i64> = (0..kills)
        .map(|_| (keys / 10 + rng.below(keys as u64 * 7 / 10) as usize) as i64)
        .collect();
    points.sort_unstable();
    let topic = Topic::create(db).await?;
    let mode = if args.mode == "correct" {
        "run"
    } else {
        args.mode.as_str()
    };
    let mut members = [1, 2].map(|number| Member::new(db, &topic, number, mode));
    let checked = async {
        let messages: Vec<String> = plan.iter().map(|key| key_name(*key)).collect();
        let published = AtomicUsize::new(0);
        let publishing = async {
            for first in (0..messages.len()).step_by(CHUNK) {
                // Kept close ahead of the group, so that a member holds few records it has
                // not read, and a partition taken over is read on at once.
                while first as i64 - sum(topic.positions(db).await?) >= AHEAD {
                    if Instant::now() >= deadline {
                        return Err("the group fell behind the publisher".to_owned());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let last = (first + CHUNK).min(messages.len());
                topic.publish(&messages[first..last], first).await?;
                published.store(last, Ordering::Relaxed);
            }
            Ok(())
        };
        let [victim, survivor] = &mut members;
        let ends_now = || ends(published.load(Ordering::Relaxed));
        let consuming = async {
            victim.start()?;
            survivor.start()?;
            let mut takeovers = Vec::new();
            let mut rejoins = Vec::new();
            'kills: for point in points {
                // Killed while it consumes: past the point, and holding partitions.
                let mut last_effect = (db.rows("effects").await, Instant::now());
                while last_effect.0 < point || !victim.took() {
                    victim.failed()?;
                    survivor.failed()?;
                    // Broken members that lose records never reach the later points: the
                    // kills stop once no effect comes, and the report says what was lost
                    // (a correct run that gets here ends undrained, which fails too).
                    if last_effect.1.elapsed() >= STALLED || Instant::now() >= deadline {
                        break 'kills;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let effects = db.rows("effects").await;
                    if effects != last_effect.0 {
                        last_effect = (effects, Instant::now());
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
                let began = Instant::now();
                victim.kill().await?;
                // A COMMIT the killed member sent may still land: read the positions after.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let before = topic.positions(db).await?;
                // Taken over once every partition is read on past where it stood at the kill.
                loop {
                    survivor.failed()?;
                    let (now, ends) = (topic.positions(db).await?, ends_now());
                    if (0..PARTITIONS).all(|p| now[p] > before[p] || now[p] >= ends[p]) {
                        takeovers.push(began.elapsed());
                        break;
                    }
                    if Instant::now() >= deadline {
                        return Err("the other member never took the partitions over".to_owned());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let restarted = Instant::now();
                victim.start()?;
                // Back once it consumes again, unless nothing is left for it.
                loop {
                    victim.failed()?;
                    survivor.failed()?;
                    if victim.took() {
                        rejoins.push(restarted.elapsed());
                        break;
                    }
                    let everything = ends(messages.len());
                    if topic.positions(db).await? == everything || Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Ok((takeovers, rejoins))
        };
        let ((), (takeovers, rejoins)) = tokio::try_join!(publishing, consuming)?;
        let ends = ends(messages.len());
        let mut drained = false;
        let mut last_effect = (db.rows("effects").await, Instant::now());
        while Instant::now() < deadline {
            victim.failed()?;
            survivor.failed()?;
            let committed = db.rows("effects").await;
            if committed != last_effect.0 {
                last_effect = (committed, Instant::now());
            }
            if topic.positions(db).await? == ends && last_effect.1.elapsed() >= QUIET {
                drained = true;
                break;
            }
            if last_effect.1.elapsed() >= STALLED {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        victim.kill().await?;
        survivor.kill().await?;
        // What the group has not read on past was never acknowledged.
        let mut acknowledged = vec![true; keys];
        let positions = topic.positions(db).await?;
        for key in topic.keys_between(positions, ends).await? {
            let index = key_index(&key).ok_or_else(|| format!("the topic held key {key:?}"))?;
            acknowledged[index as usize] = false;
        }
        let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
            .await
            .map_err(|e| format!("cannot read the effect rows: {e}"))?;
        let mut report =
            Report::compare(title, plan.len(), &vec![true; keys], &acknowledged, effects);
        report.faults = kills;
        report.recovery = takeovers;
        report.drained = drained;
        let stored = topic.stored(db).await?;
        let mut at_last = 0;
        for (partition, (stored, end)) in stored.iter().zip(ends).enumerate() {
            if *stored == Some(end - 1) {
                at_last += 1;
            } else {
                report.breaches.push(format!(
                    "partition {partition}: the offset stored in the database is {stored:?}, its \
                     last record's {}",
                    end - 1
                ));
            }
        }
        report.details = vec![
            ("partitions".to_owned(), PARTITIONS as u64),
            (
                "partitions whose stored offset is their last record's".to_owned(),
                at_last,
            ),
        ];
        report.details.extend(latency_details(
            "killed member started again: to its first record",
            &rejoins,
        ));
        Ok(report)
    }
    .await;
    let mut stopped = Ok(());
    for member in &mut members {
        stopped = stopped.and(member.kill().await);
    }
    drop(members);
    let deleted = topic.delete().await;
    crate::cleaned_up(crate::cleaned_up(checked, stopped), deleted)
}
