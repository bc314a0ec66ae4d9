//! The settings of a RabbitMQ consumer.

use crate::Policy;
use crate::consumer::policy_setters;
use crate::tls::Tls;

/// Settings of an [`AmqpConsumer`](super::AmqpConsumer).
#[derive(Debug, Clone)]
pub struct AmqpOptions {
    pub(super) queue: String,
    pub(super) policy: Policy,
    pub(super) prefetch: u16,
    pub(super) dead_letter_queue: String,
    pub(super) declare: bool,
    pub(super) queue_type: QueueType,
    pub(super) delivery_limit: Option<u32>,
    pub(super) tls: Option<Tls>,
}

/// How RabbitMQ keeps the queues it declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue, on one node.
    #[default]
    Classic,
    /// A quorum queue, replicated on a majority of the cluster's nodes by Raft. The broker
    /// counts each delivery lost with its consumer (`x-delivery-count`), and the consumer
    /// counts those as attempts. What the consumer gives back (while its database is down,
    /// or as it stops) is published again at the same attempt, so it is not counted. What
    /// passes the broker's own delivery limit goes to the dead-letter queue.
    Quorum,
}

impl AmqpOptions {
    /// Consumes `queue`: the key is the `message_id`, 16 deliveries are prefetched, failed
    /// work gets 5 attempts before it goes to `<queue>.dead`, and both queues are declared
    /// durable if missing.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            dead_letter_queue: format!("{queue}.dead"),
            queue,
            policy: Policy::default(),
            prefetch: 16,
            declare: true,
            queue_type: QueueType::Classic,
            delivery_limit: None,
            tls: None,
        }
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the
        /// `message_id` property.
    );

    /// How many unacknowledged deliveries the broker sends ahead (at least 1). With
    /// batches, twice the batch size: the next batch is gathered while one commits.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// The queue dead letters go to.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = queue.into();
        self
    }

    /// Declares the queue and its dead-letter queue as `queue_type` (classic by default).
    /// A queue that exists already must be of that type: RabbitMQ refuses the declaration
    /// otherwise, and the consumer stops with a configuration error.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Declares a quorum queue with the broker's own delivery limit (`x-delivery-limit`): a
    /// message delivered more than `limit` times without an acknowledgement goes to the
    /// dead-letter queue, by the broker, even if no consumer of justonce sees it again. The
    /// consumer's own count ([`Inbox::record_run`](justonce_sql::Inbox::record_run)) stops a
    /// message that kills its process first, when `max_attempts` is below `limit`. A classic
    /// queue has no such limit: it is not declared there.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Leaves the queues as they are instead of declaring them: for queues declared with
    /// arguments of their own, which a plain declaration would contradict.
    pub fn existing_queues(mut self) -> Self {
        self.declare = false;
        self
    }

    /// How to check the broker's certificate and which client certificate to present;
    /// the URL must be `amqps://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}
