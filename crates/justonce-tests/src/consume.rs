//! A benchmark's consumer, written once over every broker: with the tests' work, or only
//! acknowledging, which is the broker's own limit.

use crate::{TestBackend, consumer_work};
use justonce_transport::{Broker, Consumer, ConsumerStats, Receive};
use std::sync::atomic::{AtomicU64, Ordering};

/// Takes `count` deliveries from `consumer`, each time the ones that have arrived up to
/// `batch`, and runs the tests' work for them with [`Consumer::settle_batch`] (in the tables
/// under `prefix`). After each batch, stores in `settled` how many are settled. Returns
/// what the consumer counted.
pub async fn consume<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    prefix: &str,
    (count, batch): (usize, usize),
    settled: &AtomicU64,
) -> ConsumerStats {
    let work = consumer_work::<DB>(prefix);
    let mut stats = ConsumerStats::default();
    let mut deliveries = consumer.deliveries().await.expect("consuming");
    while ((stats.processed + stats.duplicates) as usize) < count {
        let first = deliveries.next().await.expect("a delivery");
        let first = first.expect("not cancelled");
        let batch = deliveries.more(first, batch).await.expect("a batch");
        (consumer.settle_batch(&batch, &work, &mut stats))
            .await
            .expect("settled");
        settled.store(stats.processed + stats.duplicates, Ordering::Relaxed);
    }
    deliveries.stop().await.expect("stopped");
    stats
}

/// Takes `count` deliveries from `broker` as [`consume`] does, in the same batches, and only
/// acknowledges them (all of a batch at once, as [`Consumer::settle_batch`] does), with no
/// database work: what the broker and its client take at most with this prefetch and batch
/// size. Stores the count acknowledged in `settled` after each batch.
pub async fn acknowledge<B: Broker>(
    broker: &B,
    (count, batch): (usize, usize),
    settled: &AtomicU64,
) {
    let mut receiver = broker.receive().await.expect("receiving");
    let mut acked = 0;
    while (acked as usize) < count {
        let first = receiver.next().await.expect("a delivery");
        let first = first.expect("not cancelled");
        let batch = receiver.more(first, batch).await.expect("a batch");
        let batch: Vec<&B::Delivery> = batch.iter().collect();
        broker
            .ack_all(&batch, &mut acked)
            .await
            .expect("acknowledged");
        settled.store(acked, Ordering::Relaxed);
    }
    receiver.stop().await.expect("stopped");
}
