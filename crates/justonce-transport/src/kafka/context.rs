//! The reader's client context: the partitions a rebalance moves, and the brokers' link.

use super::adapter::Kafka;
use super::connection::Refusals;
use crate::reconnect::Connection;
use crate::{Error, OrderedBroker};
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientContext, TopicPartitionList};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A change of the partitions the group assigned, as the rebalance callback saw it. The
/// group hands out whole assignments (its eager protocol): each replaces the one before.
#[derive(Debug, Clone)]
pub(super) enum Change {
    Assigned(Vec<i32>),
    Revoked,
}

/// What the reader's loop and librdkafka's rebalance callback share: the changes the
/// callback saw and the loop has not yet applied, oldest first, a wake-up for the loop,
/// which waits for a record that an unassigned consumer never fetches, and the partitions
/// held.
#[derive(Default)]
pub(super) struct Changes {
    pub(super) queued: Mutex<VecDeque<Change>>,
    pub(super) changed: tokio::sync::Notify,
    /// The next offset expected of each partition held: a record below it is dropped. The
    /// loop fills it when it assigns; the callback empties it when it gives the partitions
    /// up.
    pub(super) positioned: Mutex<HashMap<i32, i64>>,
    /// How many assignments the loop applied.
    pub(super) assigned: AtomicU64,
}

/// The consumer's context: forwards each rebalance to the reader's loop, and reports the
/// client's connection to the brokers as the reader's [`Link`](crate::Link).
///
/// librdkafka calls the rebalance callback synchronously, inside the poll that receives the
/// next record; it cannot wait for the database. So the callback assigns nothing: it queues
/// the group's assignment, and before it takes another record the loop loads the stored
/// offsets and assigns each partition from after its own (librdkafka waits for that call).
/// Nothing is fetched before: no record comes from where the broker would start. A
/// revocation is applied in the callback at once, in a poll that may come while a batch
/// runs (the reader reads the next one meanwhile). From then on the partitions are not
/// held ([`OrderedBroker::holds`]): the records of theirs read ahead are dropped, and a
/// failing one is not tried again, since the partitions' next reader reads them again from
/// the stored offsets. A batch already running finishes: its transaction claims its keys
/// and stores its offsets only if no reader moved past them, so nothing takes effect
/// twice.
pub(super) struct Rebalancing {
    pub(super) topic: String,
    pub(super) changes: Arc<Changes>,
    pub(super) link: BrokerLink,
    /// A refused handshake or login, to name instead of "all brokers are down".
    pub(super) refusals: Refusals,
}

impl ClientContext for Rebalancing {
    /// The client's statistics, every [`LINK_CHECK`]: connected while a broker connection
    /// is up.
    fn stats_raw(&self, statistics: &[u8]) {
        match any_broker_up(statistics) {
            Some(true) => self.link.up(),
            Some(false) => self.link.none_up(),
            None => tracing::debug!("the Kafka client's statistics are not JSON"),
        }
    }

    /// An error of the client as a whole. The reader's loop receives and logs it too. A
    /// refusal names why the brokers are down: a certificate or a login to change (say, a
    /// broker's certificate replaced while the reader runs).
    fn error(&self, error: KafkaError, reason: &str) {
        let refusal = self.refusals.note(&error, reason);
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            let recent = Instant::now()
                .checked_sub(REFUSAL_NAMES_DOWN)
                .and_then(|since| self.refusals.last_since(since));
            let cause = match recent {
                Some(refusal) => Error::from(refusal).to_string(),
                None => format!("{error} ({reason})"),
            };
            self.link.down(cause);
        } else if let Some(refusal) = refusal {
            self.link.refused(Error::from(refusal).to_string());
        }
    }
}

impl ConsumerContext for Rebalancing {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        event: RDKafkaRespErr,
        list: &mut TopicPartitionList,
    ) {
        if event == RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS {
            self.queue(Change::Assigned(self.partitions(list)));
            return;
        }
        crate::lock(&self.changes.positioned).clear();
        if event == RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS {
            self.queue(Change::Revoked);
        } else {
            tracing::warn!(
                ?event,
                "the group's rebalance failed: giving up the partitions"
            );
            self.queue(Change::Revoked);
        }
        if let Err(error) = consumer.unassign() {
            tracing::warn!(%error, "giving up the partitions failed");
        }
    }
}

/// How often the client reports its statistics, which say whether a broker connection is
/// up.
pub(super) const LINK_CHECK: Duration = Duration::from_secs(1);

/// How long a refusal names the brokers' being down: librdkafka tries a broker again
/// within 10 s.
const REFUSAL_NAMES_DOWN: Duration = Duration::from_secs(10);

/// Whether any broker connection of the client is up, from its statistics; `None` if they
/// are not JSON. librdkafka's internal broker is no connection.
fn any_broker_up(statistics: &[u8]) -> Option<bool> {
    let statistics: serde_json::Value = serde_json::from_slice(statistics).ok()?;
    let brokers = statistics.get("brokers")?.as_object()?;
    Some(
        brokers
            .values()
            .any(|broker| broker["source"] != "internal" && broker["state"] == "UP"),
    )
}

/// The reader's [`Link`](crate::Link) as the client's own signals tell it: librdkafka
/// connects again by itself, so the reader's own reconnection never sees the connection go.
pub(super) struct BrokerLink {
    pub(super) connection: Connection,
    /// The inbox consumer, which the reconnections are counted under.
    pub(super) consumer: String,
    /// Since when no broker connection is up, once one was.
    pub(super) away: Mutex<Option<Instant>>,
    /// Whether a broker connection was up once: before, the client is still connecting for
    /// the first time, which is not a lost connection.
    pub(super) was_up: AtomicBool,
}

impl BrokerLink {
    /// The client says all its brokers are down, for `error`.
    fn down(&self, error: String) {
        let mut away = crate::lock(&self.away);
        if away.is_some() {
            self.connection.still_lost(error);
        } else {
            *away = Some(Instant::now());
            self.connection.lost(error);
        }
    }

    /// The brokers refused the client for `cause`: the reason the link gives, if it is down.
    fn refused(&self, cause: String) {
        if crate::lock(&self.away).is_some() {
            self.connection.still_lost(cause);
        }
    }

    /// The statistics show no broker connection up.
    fn none_up(&self) {
        if self.was_up.load(Ordering::Relaxed) && crate::lock(&self.away).is_none() {
            self.down("no connection to a Kafka broker is up".to_owned());
        }
    }

    /// The statistics show a broker connection up.
    fn up(&self) {
        self.was_up.store(true, Ordering::Relaxed);
        if let Some(away) = crate::lock(&self.away).take() {
            self.connection
                .back(away, None, (&self.consumer, <Kafka as OrderedBroker>::NAME));
        }
    }
}

impl Rebalancing {
    fn partitions(&self, list: &TopicPartitionList) -> Vec<i32> {
        (list.elements_for_topic(&self.topic).iter())
            .map(|element| element.partition())
            .collect()
    }

    fn queue(&self, change: Change) {
        crate::lock(&self.changes.queued).push_back(change);
        self.changes.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::any_broker_up;

    /// The brokers of librdkafka's statistics, trimmed to the fields read: the internal
    /// broker is always up and says nothing of the connection.
    fn statistics(bootstrap: &str, learned: &str) -> Vec<u8> {
        format!(
            r#"{{"name": "rdkafka#consumer-1", "type": "consumer", "brokers": {{
                ":0/internal": {{"name": ":0/internal", "nodeid": -1, "source": "internal", "state": "UP"}},
                "127.0.0.1:9092/bootstrap": {{"name": "127.0.0.1:9092/bootstrap", "nodeid": -1, "source": "configured", "state": "{bootstrap}"}},
                "127.0.0.1:9092/1": {{"name": "127.0.0.1:9092/1", "nodeid": 1, "source": "learned", "state": "{learned}"}}
            }}}}"#
        )
        .into_bytes()
    }
    #[test]
    fn a_broker_connection_is_up_when_a_broker_but_the_internal_one_says_up() {
        assert_eq!(any_broker_up(&statistics("INIT", "UP")), Some(true));
        assert_eq!(any_broker_up(&statistics("UP", "INIT")), Some(true));
        assert_eq!(any_broker_up(&statistics("DOWN", "CONNECT")), Some(false));
        assert_eq!(any_broker_up(b"not json"), None);
    }
}
