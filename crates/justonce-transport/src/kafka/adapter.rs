//! The Kafka adapter of the reader: a consumer-group member that keeps its offsets in the
//! database.

use super::OwnedMessage;
use super::connection::{RECOVERY_POLL, Refusals, broker, recovers_by_itself, unrecoverable};
use super::context::{BrokerLink, Change, Changes, LINK_CHECK, Rebalancing};
use super::destination::Producer;
use super::options::{KafkaOptions, NO_MESSAGE_ID, Start};
use crate::consumer::{Receive, Received};
use crate::reconnect::Connection;
use crate::{
    ATTEMPT_HEADER, Error, KeyFrom, OrderedBroker, Policy, Position, REASON_BYTES, REASON_HEADER,
    StoredOffsets, truncate,
};
use justonce_sql::{Backend, Inbox, Offset};
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A Kafka consumer-group member that runs each record's work once in effect, with the
/// record's key claimed and its partition's offset stored in the same transaction: the one
/// generic [`Reader`](crate::Reader) over the [`Kafka`] adapter.
///
/// Records are read in order within each partition. Members of one group share the
/// partitions; give each the same inbox consumer name, since the offsets are stored under
/// it. The broker's committed offsets are neither read nor written.
pub type KafkaReader<DB> = crate::Reader<Kafka, DB>;

/// The Kafka adapter of [`KafkaReader`]: a consumer-group member that assigns each partition
/// it is given from after its stored offset.
pub struct Kafka {
    consumer: StreamConsumer<Rebalancing>,
    changes: Arc<Changes>,
    producer: Producer,
    options: KafkaOptions,
}

debug_shows_options!(Kafka);

impl<DB: Backend> KafkaReader<DB> {
    /// Joins the group and subscribes to the topic; the brokers are reached when reading
    /// starts. Refuses [`KeyFrom::MessageId`] and a bad URL.
    pub fn connect(url: &str, inbox: Inbox<DB>, options: KafkaOptions) -> Result<Self, Error> {
        if options.policy.key_from == KeyFrom::MessageId {
            return Err(Error::Config(NO_MESSAGE_ID.to_owned()));
        }
        let config = options.security.client_config(url)?;
        let changes = Arc::new(Changes::default());
        let connection = Connection::default();
        let context = Rebalancing {
            topic: options.topic.clone(),
            changes: Arc::clone(&changes),
            link: BrokerLink {
                connection: connection.clone(),
                consumer: inbox.consumer().as_str().to_owned(),
                away: Mutex::default(),
                was_up: AtomicBool::default(),
            },
            refusals: Refusals::diagnosed_aside(&options.security, url),
        };
        let start = match options.start {
            Start::Earliest => "earliest",
            Start::Latest => "latest",
        };
        let consumer: StreamConsumer<Rebalancing> = config
            .clone()
            .set("group.id", &options.group)
            // The offsets live in the database: the broker's are neither stored nor read.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", start)
            .set("statistics.interval.ms", LINK_CHECK.as_millis().to_string())
            .set(
                "session.timeout.ms",
                options.session_timeout.as_millis().to_string(),
            )
            // Three heartbeats per session, as Kafka advises: librdkafka's default of 3 s
            // would let a short session lapse between two heartbeats of a live member.
            .set(
                "heartbeat.interval.ms",
                (options.session_timeout / 3).as_millis().max(1).to_string(),
            )
            .create_with_context(context)
            .map_err(|e| Error::Config(format!("Kafka consumer: {e}")))?;
        consumer
            .subscribe(&[&options.topic])
            .map_err(|e| Error::Config(format!("subscribing to {}: {e}", options.topic)))?;
        let kafka = Kafka {
            consumer,
            changes,
            producer: Producer::new(&config, Refusals::new(&options.security, url))?,
            options,
        };
        Ok(Self::reporting(kafka, inbox, connection))
    }
}

/// The records of the partitions assigned to a [`Kafka`] member, each partition in order.
pub struct Records<'k> {
    kafka: &'k Kafka,
    stored: StoredOffsets,
    /// How many changes of the assignment this reader has applied.
    applied: u64,
}

impl Receive for Records<'_> {
    type Delivery = OwnedMessage;

    /// The next record of an assigned partition, after the partition's stored offset.
    /// Cancelling it loses nothing: an assignment is applied again, and a record is only
    /// taken when it is returned.
    async fn next(&mut self) -> Result<Option<OwnedMessage>, Error> {
        let kafka = self.kafka;
        loop {
            self.apply_changes().await;
            let record = tokio::select! {
                record = kafka.consumer.recv() => match record {
                    Ok(record) => record.detach(),
                    Err(error) if recovers_by_itself(&error) => {
                        tracing::warn!(%error, "Kafka client error: the client recovers by itself");
                        tokio::time::sleep(RECOVERY_POLL).await;
                        continue;
                    }
                    Err(error) => return Err(unrecoverable(error)),
                },
                () = kafka.changes.changed.notified() => continue,
            };
            // Nothing is awaited from here on: the record is either returned or dropped. A
            // change queued during this poll makes the assignment it came from stale.
            if !crate::lock(&kafka.changes.queued).is_empty() {
                continue;
            }
            let mut positioned = crate::lock(&kafka.changes.positioned);
            match positioned.get_mut(&record.partition()) {
                Some(next) if record.offset() >= *next => {
                    *next = record.offset() + 1;
                    return Ok(Some(record));
                }
                _ => continue,
            }
        }
    }

    /// `first` and the records already fetched after it, as every receiver takes them; none
    /// if the assignment changed meanwhile. A rebalance comes in a poll, and polls happen
    /// here while the batch waits to run: a partition released in one may already be read
    /// by another member, from its stored offset, so its records must not run here. They
    /// are read again by whoever holds the partition next.
    async fn more(
        &mut self,
        first: OwnedMessage,
        batch_size: usize,
    ) -> Result<Vec<OwnedMessage>, Error> {
        let applied = self.applied;
        let mut batch = vec![first];
        while batch.len() < batch_size {
            let next = tokio::time::timeout(crate::consumer::BATCH_WAIT, self.next()).await;
            if self.applied != applied || !crate::lock(&self.kafka.changes.queued).is_empty() {
                return Ok(Vec::new());
            }
            match next {
                Ok(next) => match next? {
                    Some(record) => batch.push(record),
                    None => break,
                },
                Err(_) => break,
            }
        }
        Ok(batch)
    }
}

impl Records<'_> {
    /// Applies the latest change the rebalance callback queued, which replaces those before
    /// it; the queue is emptied only once it is applied, so that a cancelled call leaves it
    /// for the next.
    async fn apply_changes(&mut self) {
        let kafka = self.kafka;
        loop {
            let (latest, queued) = {
                let changes = crate::lock(&kafka.changes.queued);
                match changes.back() {
                    Some(latest) => (latest.clone(), changes.len()),
                    None => return,
                }
            };
            match latest {
                // The callback gave the partitions up.
                Change::Revoked => {}
                Change::Assigned(partitions) => {
                    while let Err(error) = self.assign(&partitions).await {
                        tracing::warn!(%error, "assigning partitions failed: trying again");
                        tokio::time::sleep(kafka.options.policy.store_pause).await;
                    }
                }
            }
            crate::lock(&kafka.changes.queued).drain(..queued);
            self.applied += 1;
        }
    }

    /// Assigns `partitions`, each from after its stored offset or at the configured start.
    async fn assign(&self, partitions: &[i32]) -> Result<(), Error> {
        let kafka = self.kafka;
        let topic = &kafka.options.topic;
        let mut list = TopicPartitionList::new();
        let mut positioned = HashMap::with_capacity(partitions.len());
        for &partition in partitions {
            let (start, next) = match self.stored.offset(topic, partition).await? {
                Some(offset) => (
                    rdkafka::Offset::Offset(offset.position + 1),
                    offset.position + 1,
                ),
                None => match kafka.options.start {
                    Start::Earliest => (rdkafka::Offset::Beginning, 0),
                    Start::Latest => (rdkafka::Offset::End, 0),
                },
            };
            list.add_partition_offset(topic, partition, start)
                .map_err(broker)?;
            positioned.insert(partition, next);
        }
        kafka.consumer.assign(&list).map_err(broker)?;
        *crate::lock(&kafka.changes.positioned) = positioned;
        kafka.changes.assigned.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            ?partitions,
            "assigned partitions after their stored offsets"
        );
        Ok(())
    }
}

impl OrderedBroker for Kafka {
    type Entry = OwnedMessage;
    type Entries<'b> = Records<'b>;
    const NAME: &'static str = "kafka";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// Each partition starts after its stored offset when the group assigns it. A read
    /// after another (once a lost connection is back) assigns the partitions held again,
    /// each from after its stored offset: the client's position is past records taken and
    /// not stored, which would otherwise never run.
    async fn read(&self, stored: StoredOffsets) -> Result<Records<'_>, Error> {
        let mut held: Vec<i32> = crate::lock(&self.changes.positioned)
            .keys()
            .copied()
            .collect();
        if !held.is_empty() {
            held.sort_unstable();
            let mut queued = crate::lock(&self.changes.queued);
            // A change queued already is applied first, and assigns from the stored offsets.
            if queued.is_empty() {
                queued.push_back(Change::Assigned(held));
            }
        }
        Ok(Records {
            kafka: self,
            stored,
            applied: 0,
        })
    }

    /// librdkafka connects again by itself, and a partition it reassigns starts after its
    /// stored offset: nothing to do.
    async fn reconnect(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Until the rebalance callback gives the record's partition up; a partition given back
    /// to this member is read again from its stored offset.
    fn holds(&self, record: &OwnedMessage) -> bool {
        crate::lock(&self.changes.positioned).contains_key(&record.partition())
    }

    /// Each assignment the group makes: the record a partition starts at may be the one its
    /// previous member died on.
    fn assignments(&self) -> u64 {
        self.changes.assigned.load(Ordering::Relaxed)
    }

    fn position<'e>(&'e self, record: &'e OwnedMessage) -> Result<Position<'e>, String> {
        Ok(Position {
            stream: &self.options.topic,
            partition: record.partition(),
            offset: Offset::from(record.offset()),
        })
    }

    /// Produces the record, with its key, its headers, the attempt and the reason, to
    /// `<topic>.dead`, and waits for the brokers to acknowledge it. A reader that dies
    /// before it moves the offset produces it again.
    async fn dead_letter(
        &self,
        record: &OwnedMessage,
        attempt: u32,
        reason: &str,
    ) -> Result<(), Error> {
        let mut headers = OwnedHeaders::new();
        for header in record
            .headers()
            .into_iter()
            .flat_map(|headers| headers.iter())
        {
            if header.key != ATTEMPT_HEADER && header.key != REASON_HEADER {
                headers = headers.insert(header);
            }
        }
        let attempt = attempt.to_string();
        let headers = headers
            .insert(Header {
                key: ATTEMPT_HEADER,
                value: Some(attempt.as_str()),
            })
            .insert(Header {
                key: REASON_HEADER,
                value: Some(truncate(reason, REASON_BYTES)),
            });
        let topic = self.options.dead_letter_topic();
        let mut letter = FutureRecord::<[u8], [u8]>::to(&topic).headers(headers);
        if let Some(key) = record.key() {
            letter = letter.key(key);
        }
        if let Some(payload) = record.payload() {
            letter = letter.payload(payload);
        }
        self.producer.send(letter).await
    }
}

impl Received for OwnedMessage {
    fn message_id(&self) -> Result<String, String> {
        Err(NO_MESSAGE_ID.to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        let header = self.headers()?.iter().find(|header| header.key == name)?;
        String::from_utf8(header.value?.to_vec()).ok()
    }

    fn no_header(&self, name: &str) -> String {
        format!("the record has no header {name}")
    }

    fn log_id(&self) -> String {
        format!(
            "{} partition {} offset {}",
            self.topic(),
            self.partition(),
            self.offset()
        )
    }

    fn body(&self) -> Vec<u8> {
        self.payload().unwrap_or_default().to_vec()
    }

    fn content_type(&self) -> Option<String> {
        self.header("content-type")
    }

    /// A reader runs a record again in place: the broker delivered it once.
    fn attempt(&self) -> u32 {
        1
    }
}
