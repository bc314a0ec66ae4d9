//! Leases: one holder at a time, fencing tokens, expiry by the store's clock. The same
//! test bodies run on every lease store (SQLite, PostgreSQL and Redis); one more checks
//! that a SQL key is one key whichever way it was claimed.

use super::{LeaseStore, key, on_every_database, on_every_lease_store, process};
use justonce_sql::{Claim, Error, Fingerprint, Identity, Lease, LeaseClaim, Leases, Scope};
use justonce_tests::{TestBackend, TestDb};
use std::sync::Arc;
use std::time::Duration;

on_every_lease_store!(
    one_holder_then_done_with_its_result,
    thirty_two_racers_acquire_once,
    a_taken_over_holder_is_fenced_off,
    a_released_key_is_taken_at_once_with_a_larger_token,
    a_renewed_lease_is_not_taken_over,
    another_payload_is_a_key_reuse,
    scopes_and_consumers_keep_keys_apart,
);

on_every_database!(a_key_is_claimed_once_whichever_way);

/// A key completed with `result`, as a lease claim sees it.
fn done_with(result: &[u8]) -> LeaseClaim {
    LeaseClaim::Done {
        result: Some(result.to_vec()),
    }
}

/// An identity for consumer `test` in no scope.
fn identity(text: &str) -> Identity {
    Identity::new(
        Scope::none(),
        justonce_sql::Consumer::new("test").unwrap(),
        key(text),
    )
}

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(300);

fn print(payload: &str) -> Fingerprint {
    Fingerprint::of(payload)
}

async fn acquire(leases: &dyn Leases, id: &Identity, lease_for: Duration) -> Lease {
    match leases.claim_lease(id, &print("p"), lease_for).await {
        Ok(LeaseClaim::Acquired(lease)) => lease,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

async fn one_holder_then_done_with_its_result<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let id = identity("charge:1");
    let LeaseClaim::Acquired(lease) = leases.claim_lease(&id, &print("p"), LONG).await.unwrap()
    else {
        panic!("the first claim acquires");
    };
    assert_eq!(lease.token, 1);
    match leases.claim_lease(&id, &print("p"), LONG).await.unwrap() {
        LeaseClaim::InProgress { remaining } => {
            assert!(
                remaining > Duration::from_secs(50) && remaining <= LONG,
                "{remaining:?}"
            )
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    leases.complete(&lease, b"receipt-1").await.unwrap();
    assert_eq!(
        leases.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        done_with(b"receipt-1")
    );
    let again = leases.complete(&lease, b"receipt-2").await.unwrap_err();
    assert!(
        matches!(again, Error::LeaseLost { .. }),
        "a done key is not completed twice: {again}"
    );
    store.close().await;
}

async fn thirty_two_racers_acquire_once<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let id = identity("charge:race");
    let racers: Vec<_> = (0..32)
        .map(|_| {
            let (leases, id) = (Arc::clone(&leases), id.clone());
            tokio::spawn(async move { leases.claim_lease(&id, &print("p"), LONG).await.unwrap() })
        })
        .collect();
    let mut holders = Vec::new();
    for racer in racers {
        match racer.await.unwrap() {
            LeaseClaim::Acquired(lease) => holders.push(lease),
            LeaseClaim::InProgress { .. } => {}
            other => panic!("a racer got {other:?}"),
        }
    }
    assert_eq!(holders.len(), 1, "exactly one racer holds the key");
    leases.complete(&holders[0], b"charged once").await.unwrap();
    let later: Vec<_> = (0..32)
        .map(|_| {
            let (leases, id) = (Arc::clone(&leases), id.clone());
            tokio::spawn(async move { leases.claim_lease(&id, &print("p"), LONG).await.unwrap() })
        })
        .collect();
    for claim in later {
        assert_eq!(claim.await.unwrap(), done_with(b"charged once"));
    }
    store.close().await;
}

async fn a_taken_over_holder_is_fenced_off<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let id = identity("charge:slow");
    let LeaseClaim::Acquired(slow) = leases.claim_lease(&id, &print("p"), SHORT).await.unwrap()
    else {
        panic!("the first claim acquires");
    };
    // Not before expiry, by the store's clock.
    assert!(matches!(
        leases.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        LeaseClaim::InProgress { .. }
    ));
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let LeaseClaim::Acquired(fresh) = leases.claim_lease(&id, &print("p"), LONG).await.unwrap()
    else {
        panic!("an expired lease is taken over");
    };
    assert!(fresh.token > slow.token);
    for refused in [
        leases.renew(&slow, LONG).await,
        leases.release(&slow).await,
        leases.complete(&slow, b"slow result").await,
    ] {
        assert!(
            matches!(refused, Err(Error::LeaseLost { .. })),
            "{refused:?}"
        );
    }
    leases.complete(&fresh, b"fresh result").await.unwrap();
    assert_eq!(
        leases.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        done_with(b"fresh result")
    );
    store.close().await;
}

async fn a_released_key_is_taken_at_once_with_a_larger_token<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let id = identity("charge:declined");
    let lease = acquire(leases.as_ref(), &id, LONG).await;
    leases.release(&lease).await.unwrap();
    let (first, second) = (lease.token, acquire(leases.as_ref(), &id, LONG).await.token);
    assert!(second > first, "{second} after {first}");
    assert!(matches!(
        leases.release(&lease).await,
        Err(Error::LeaseLost { .. })
    ));
    store.close().await;
}

async fn a_renewed_lease_is_not_taken_over<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let id = identity("export:long");
    let lease = acquire(leases.as_ref(), &id, SHORT).await;
    leases.renew(&lease, LONG).await.unwrap();
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert!(matches!(
        leases.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        LeaseClaim::InProgress { .. }
    ));
    store.close().await;
}

async fn another_payload_is_a_key_reuse<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let id = identity("charge:reused");
    let lease = acquire(leases.as_ref(), &id, SHORT).await;
    let reused = LeaseClaim::KeyReused {
        stored: print("p"),
        received: print("other"),
    };
    assert_eq!(
        leases
            .claim_lease(&id, &print("other"), LONG)
            .await
            .unwrap(),
        reused
    );
    // Nor is an expired lease taken over for another payload.
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert_eq!(
        leases
            .claim_lease(&id, &print("other"), LONG)
            .await
            .unwrap(),
        reused
    );
    leases.complete(&lease, b"done").await.unwrap();
    assert_eq!(
        leases
            .claim_lease(&id, &print("other"), LONG)
            .await
            .unwrap(),
        reused
    );
    store.close().await;
}

async fn a_key_is_claimed_once_whichever_way<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let in_transaction = key("job:1");
    assert_eq!(
        process(&db, &db.inbox, &in_transaction, b"p").await,
        justonce_sql::Outcome::Processed(())
    );
    assert_eq!(
        db.inbox
            .claim_lease(&db.inbox.identity(&in_transaction), &print("p"), LONG)
            .await
            .unwrap(),
        LeaseClaim::Done { result: None },
        "a key claimed in a transaction is done to a lease claim"
    );
    let leased = key("job:2");
    acquire(&db.inbox, &db.inbox.identity(&leased), LONG).await;
    let mut tx = db.inbox.begin().await.unwrap();
    assert_eq!(
        db.inbox.claim(&mut tx, &leased, b"p").await.unwrap(),
        Claim::Duplicate,
        "a leased key is taken to a transactional claim"
    );
    tx.rollback().await.unwrap();
    assert_eq!(db.rows("effects").await, 1);
    db.cleanup().await;
}

async fn scopes_and_consumers_keep_keys_apart<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let consumer = |name: &str| justonce_sql::Consumer::new(name).unwrap();
    // Lengths separate the parts, so these three never meet, whatever their texts.
    let ids = [
        Identity::new(Scope::new("a").unwrap(), consumer("b:c"), key("k")),
        Identity::new(Scope::new("a:b").unwrap(), consumer("c"), key("k")),
        Identity::new(Scope::none(), consumer("a:b:c"), key("k")),
    ];
    for id in &ids {
        acquire(leases.as_ref(), id, LONG).await;
    }
    assert_each_held(leases.as_ref(), &ids).await;
    store.close().await;
}

/// Each identity is held once, by its own lease.
async fn assert_each_held(leases: &dyn Leases, ids: &[Identity]) {
    for id in ids {
        assert!(matches!(
            leases.claim_lease(id, &print("p"), LONG).await.unwrap(),
            LeaseClaim::InProgress { .. }
        ));
    }
}
