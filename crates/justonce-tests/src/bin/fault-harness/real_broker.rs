//! `broker-kill`: the workload published to a queue of the run's own on a real broker and
//! consumed by a `broker-worker` process, the project's real consumer, SIGKILLed at random
//! moments and restarted, until the broker says that every message was
//! acknowledged.

use crate::broker::{key_index, key_name, sibling};
use crate::report::Report;
use crate::{Args, Rng};
use justonce_tests::{TestBackend, TestDb};
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// The brokers `--broker` takes.
pub const BROKERS: [&str; 1] = ["amqp"];

/// A RabbitMQ queue of the run's own, and its dead-letter queue.
struct Queue {
    url: String,
    name: String,
    connection: Connection,
}

impl Queue {
    /// Declares the queues as the consumer does.
    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Result<Self, String> {
        let url = justonce_tests::amqp_url();
        let name = format!("{}broker_kill", db.prefix);
        let consumer = AmqpConsumer::connect(&url, db.inbox.clone(), AmqpOptions::new(&name))
            .await
            .map_err(|e| format!("RabbitMQ at {url}: {e}"))?;
        consumer.close().await.map_err(|e| e.to_string())?;
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .map_err(|e| format!("RabbitMQ at {url}: {e}"))?;
        Ok(Self {
            url,
            name,
            connection,
        })
    }

    /// Messages ready in the queue. With no consumer connected, these are the deliveries
    /// never acknowledged: RabbitMQ gives back what a closed or dead consumer held.
    async fn ready(&self) -> Result<u32, String> {
        let channel = self.channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let queue = channel
            .queue_declare(self.name.as_str().into(), passive, Default::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(queue.message_count())
    }

    /// Takes the ready messages out of the queue: the key of each.
    async fn take_ready(&self) -> Result<Vec<String>, String> {
        let channel = self.channel().await?;
        let mut keys = Vec::new();
        while let Some(message) = channel
            .basic_get(self.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .map_err(|e| e.to_string())?
        {
            let id = message.delivery.properties.message_id().as_ref();
            keys.push(id.map(ToString::to_string).unwrap_or_default());
        }
        Ok(keys)
    }

    async fn delete(self) -> Result<(), String> {
        let channel = self.channel().await?;
        for queue in [format!("{}.dead", self.name), self.name] {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    async fn channel(&self) -> Result<lapin::Channel, String> {
        self.connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())
    }
}

/// The consumer process, replaced by a new one when it is killed.
struct Consumer<'a, DB: TestBackend> {
    db: &'a TestDb<DB>,
    queue: &'a Queue,
    /// `broker-worker`'s mode: `run`, or a deliberately broken one.
    mode: &'a str,
    running: Option<Child>,
}

impl<DB: TestBackend> Consumer<'_, DB> {
    fn start(&mut self) -> Result<(), String> {
        let queue = self.queue;
        let child = Command::new(sibling("broker-worker"))
            .args([
                &self.db.url,
                &self.db.prefix,
                &queue.url,
                &queue.name,
                "consumer",
                self.mode,
            ])
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start broker-worker: {e}"))?;
        self.running = Some(child);
        Ok(())
    }

    /// SIGKILLs the consumer and waits until it is gone: what it held goes back to the
    /// queue.
    async fn kill(&mut self) -> Result<(), String> {
        if let Some(mut child) = self.running.take() {
            child
                .kill()
                .await
                .map_err(|e| format!("cannot kill the consumer: {e}"))?;
        }
        Ok(())
    }

    /// An error if the consumer exited on its own: it failed.
    fn failed(&mut self) -> Result<(), String> {
        if let Some(child) = &mut self.running
            && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
        {
            return Err(format!("broker-worker exited on its own: {status}"));
        }
        Ok(())
    }
}

/// Publishes `keys` distinct keys, a tenth of them twice, shuffled; runs the consumer,
/// killing it at random moments, until the queue is settled; and compares the broker's
/// account with the effect rows.
pub async fn broker_kill<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let keys = args.size(2_000, 20_000);
    let kills = args.size(10, 100);
    let deadline = Instant::now() + Duration::from_secs(args.size(50, 900) as u64);
    let mut plan: Vec<u32> = (0..keys as u32).chain(0..keys as u32 / 10).collect();
    rng.shuffle(&mut plan);
    let queue = Queue::open(db).await?;
    let published: Vec<String> = plan.iter().map(|key| key_name(*key)).collect();
    justonce_tests::publish_keys(&queue.connection, &queue.name, &published).await;

    // Kill points: after random numbers of effects, well inside the run so that there is
    // work left to recover to, plus a few random milliseconds so that the consumer is
    // caught at any point of a delivery.
    let mut points: Vec<i64> = (0..kills)
        .map(|_| (keys / 20 + rng.below(keys as u64 * 17 / 20) as usize) as i64)
        .collect();
    points.sort_unstable();
    let effects = async || db.rows("effects").await;
    let mut consumer = Consumer {
        db,
        queue: &queue,
        mode: if args.mode == "correct" {
            "run"
        } else {
            &args.mode
        },
        running: None,
    };
    consumer.start()?;
    let mut faults = 0;
    let mut recovery = Vec::new();
    let mut drained = false;
    let mut quiet_since = None;
    let mut points = points.into_iter().peekable();
    while Instant::now() < deadline {
        consumer.failed()?;
        let committed = effects().await;
        if points.next_if(|point| committed >= *point).is_some() {
            tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
            let began = Instant::now();
            consumer.kill().await?;
            consumer.start()?;
            faults += 1;
            // Recovered at the next effect committed after the kill: the new consumer's.
            // A kill with nothing left to commit has no recovery.
            let before = effects().await;
            let given_up = Instant::now() + Duration::from_secs(10);
            while Instant::now() < given_up.min(deadline) {
                if effects().await > before {
                    recovery.push(began.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        } else if points.peek().is_none() && queue.ready().await? == 0 {
            // Nothing is waiting: once that has held long enough for the consumer to
            // acknowledge what it took, stop it, and the broker counts what it left
            // unacknowledged. Anything left is delivered again to a new consumer.
            let quiet = *quiet_since.get_or_insert_with(Instant::now);
            if quiet.elapsed() >= Duration::from_millis(300) {
                consumer.kill().await?;
                if queue.ready().await? == 0 {
                    drained = true;
                    break;
                }
                consumer.start()?;
                quiet_since = None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        } else {
            quiet_since = None;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    consumer.kill().await?;
    // What the broker still holds was never acknowledged.
    let mut acknowledged = vec![true; keys];
    for key in queue.take_ready().await? {
        let index = key_index(&key).ok_or_else(|| format!("the queue held key {key:?}"))?;
        acknowledged[index as usize] = false;
    }
    queue.delete().await?;
    let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
        .await
        .map_err(|e| format!("cannot read the effect rows: {e}"))?;
    let mut report = Report::compare(title, plan.len(), &vec![true; keys], &acknowledged, effects);
    report.faults = faults;
    report.recovery = recovery;
    report.drained = drained;
    Ok(report)
}
