//! Leases on the keys table: one holder at a time, fencing tokens, expiry by the store's
//! clock, and one key whichever way it was claimed.

use super::{key, on_every_database, process};
use justonce_sql::{Claim, ErrorKind, Fingerprint, Identity, LeaseClaim, Leases};
use justonce_tests::{TestBackend, TestDb};
use std::time::Duration;

on_every_database!(
    one_holder_then_done_with_its_result,
    thirty_two_racers_acquire_once,
    a_taken_over_holder_is_fenced_off,
    a_released_key_is_taken_at_once_with_a_larger_token,
    a_renewed_lease_is_not_taken_over,
    another_payload_is_a_key_reuse,
    a_key_is_claimed_once_whichever_way,
);

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(300);

fn print(payload: &str) -> Fingerprint {
    Fingerprint::of(payload)
}

async fn acquire<DB: TestBackend>(db: &TestDb<DB>, id: &Identity, lease_for: Duration) -> i64 {
    match db.inbox.claim_lease(id, &print("p"), lease_for).await {
        Ok(LeaseClaim::Acquired(lease)) => lease.token,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

async fn one_holder_then_done_with_its_result<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = db.inbox.identity(&key("charge:1"));
    let LeaseClaim::Acquired(lease) = db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap()
    else {
        panic!("the first claim acquires");
    };
    assert_eq!(lease.token, 1);
    match db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap() {
        LeaseClaim::InProgress { remaining } => {
            assert!(
                remaining > Duration::from_secs(50) && remaining <= LONG,
                "{remaining:?}"
            )
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    db.inbox.complete(&lease, b"receipt-1").await.unwrap();
    assert_eq!(
        db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        LeaseClaim::Done {
            result: Some(b"receipt-1".to_vec())
        }
    );
    let again = db.inbox.complete(&lease, b"receipt-2").await.unwrap_err();
    assert_eq!(
        again.kind(),
        ErrorKind::LeaseLost,
        "a done key is not completed twice"
    );
    assert_eq!(db.rows("keys").await, 1);
    db.cleanup().await;
}

async fn thirty_two_racers_acquire_once<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = db.inbox.identity(&key("charge:race"));
    let racers: Vec<_> = (0..32)
        .map(|_| {
            let (inbox, id) = (db.inbox.clone(), id.clone());
            tokio::spawn(async move { inbox.claim_lease(&id, &print("p"), LONG).await.unwrap() })
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
    db.inbox
        .complete(&holders[0], b"charged once")
        .await
        .unwrap();
    let later: Vec<_> = (0..32)
        .map(|_| {
            let (inbox, id) = (db.inbox.clone(), id.clone());
            tokio::spawn(async move { inbox.claim_lease(&id, &print("p"), LONG).await.unwrap() })
        })
        .collect();
    for claim in later {
        assert_eq!(
            claim.await.unwrap(),
            LeaseClaim::Done {
                result: Some(b"charged once".to_vec())
            }
        );
    }
    db.cleanup().await;
}

async fn a_taken_over_holder_is_fenced_off<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = db.inbox.identity(&key("charge:slow"));
    let LeaseClaim::Acquired(slow) = db.inbox.claim_lease(&id, &print("p"), SHORT).await.unwrap()
    else {
        panic!("the first claim acquires");
    };
    // Not before expiry, by the store's clock.
    assert!(matches!(
        db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        LeaseClaim::InProgress { .. }
    ));
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let LeaseClaim::Acquired(fresh) = db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap()
    else {
        panic!("an expired lease is taken over");
    };
    assert!(fresh.token > slow.token);
    for refused in [
        db.inbox.renew(&slow, LONG).await,
        db.inbox.release(&slow).await,
        db.inbox.complete(&slow, b"slow result").await,
    ] {
        assert_eq!(refused.unwrap_err().kind(), ErrorKind::LeaseLost);
    }
    db.inbox.complete(&fresh, b"fresh result").await.unwrap();
    assert_eq!(
        db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        LeaseClaim::Done {
            result: Some(b"fresh result".to_vec())
        }
    );
    db.cleanup().await;
}

async fn a_released_key_is_taken_at_once_with_a_larger_token<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = db.inbox.identity(&key("charge:declined"));
    let first = acquire(&db, &id, LONG).await;
    let lease = justonce_sql::Lease {
        identity: id.clone(),
        token: first,
    };
    db.inbox.release(&lease).await.unwrap();
    let second = acquire(&db, &id, LONG).await;
    assert!(second > first, "{second} after {first}");
    assert_eq!(
        db.inbox.release(&lease).await.unwrap_err().kind(),
        ErrorKind::LeaseLost
    );
    db.cleanup().await;
}

async fn a_renewed_lease_is_not_taken_over<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = db.inbox.identity(&key("export:long"));
    let token = acquire(&db, &id, SHORT).await;
    let lease = justonce_sql::Lease {
        identity: id.clone(),
        token,
    };
    db.inbox.renew(&lease, LONG).await.unwrap();
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert!(matches!(
        db.inbox.claim_lease(&id, &print("p"), LONG).await.unwrap(),
        LeaseClaim::InProgress { .. }
    ));
    db.cleanup().await;
}

async fn another_payload_is_a_key_reuse<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = db.inbox.identity(&key("charge:reused"));
    let token = acquire(&db, &id, SHORT).await;
    let reused = LeaseClaim::KeyReused {
        stored: print("p"),
        received: print("other"),
    };
    assert_eq!(
        db.inbox
            .claim_lease(&id, &print("other"), LONG)
            .await
            .unwrap(),
        reused
    );
    // Nor is an expired lease taken over for another payload.
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert_eq!(
        db.inbox
            .claim_lease(&id, &print("other"), LONG)
            .await
            .unwrap(),
        reused
    );
    let lease = justonce_sql::Lease {
        identity: id.clone(),
        token,
    };
    db.inbox.complete(&lease, b"done").await.unwrap();
    assert_eq!(
        db.inbox
            .claim_lease(&id, &print("other"), LONG)
            .await
            .unwrap(),
        reused
    );
    db.cleanup().await;
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
    acquire(&db, &db.inbox.identity(&leased), LONG).await;
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
