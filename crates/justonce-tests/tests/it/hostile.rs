//! Hostile keys, consumer names and scopes on every store: what the types accept is stored
//! and found again byte for byte, once, with the tables intact; identical keys under two
//! scopes never see each other's results.

use super::{LeaseStore, key, on_every_database, on_every_lease_store, process};
use justonce_sql::{Claim, Consumer, Fingerprint, Identity, LeaseClaim, Outcome, Scope};
use justonce_tests::{TestBackend, TestDb};
use std::time::Duration;

on_every_database!(hostile_but_valid_identities_are_stored_once_as_given);
on_every_lease_store!(tenants_never_see_each_others_results);

const CRAB: &str = "\u{1f980}";

/// Texts the identity types accept, each a distinct key: byte comparison keeps apart the
/// ones that look alike.
fn hostile_keys(prefix: &str) -> Vec<String> {
    vec![
        " ".to_owned(),
        "   ".to_owned(),
        "'; DROP TABLE x; --".to_owned(),
        format!("x'); DROP TABLE {prefix}keys; --"),
        "a\\b%_\"`".to_owned(),
        format!("{CRAB}\u{1f468}\u{200d}\u{1f469}"),
        "ab".to_owned(),
        "a\u{200f}b".to_owned(),
        "k".repeat(255),
        format!("{}kkk", CRAB.repeat(63)),
        "\u{20ac}".repeat(85),
    ]
}

async fn hostile_but_valid_identities_are_stored_once_as_given<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let consumer = Consumer::new("'; DROP TABLE x; --").unwrap();
    let scope = Scope::new(CRAB.repeat(32)).unwrap();
    assert_eq!(
        (consumer.as_str().len(), scope.as_str().len()),
        (19, Scope::MAX_LEN)
    );
    let inbox = db
        .inbox
        .with_consumer(consumer.clone())
        .with_scope(scope.clone());
    let keys: Vec<_> = hostile_keys(&db.prefix).iter().map(|k| key(k)).collect();
    for key in &keys {
        assert_eq!(
            process(&db, &inbox, key, b"p").await,
            Outcome::Processed(())
        );
        assert_eq!(process(&db, &inbox, key, b"p").await, Outcome::Duplicate);
    }
    let stored = keys.len() as i64;
    assert_eq!(
        (db.rows("keys").await, db.rows("effects").await),
        (stored, stored)
    );
    db.inbox.check().await.expect("the tables are intact");
    // Found again by value, one at a time and through the batch claim.
    for key in &keys {
        let found = inbox.lookup(&inbox.identity(key)).await.unwrap();
        assert_eq!(found.map(|k| k.fingerprint), Some(Fingerprint::of(b"p")));
    }
    let batch: Vec<_> = keys.iter().map(|k| (k.clone(), &b"p"[..])).collect();
    let mut tx = inbox.begin().await.unwrap();
    let claims = inbox.claim_many(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    assert!(claims.iter().all(|c| *c == Claim::Duplicate), "{claims:?}");
    // The consumer and scope read back as written.
    let counts = db.inbox.key_counts().await.unwrap();
    let [count] = counts.as_slice() else {
        panic!("one consumer and scope: {counts:?}");
    };
    assert_eq!(
        (count.consumer.as_str(), count.scope.as_str(), count.keys),
        (consumer.as_str(), scope.as_str(), stored)
    );
    db.cleanup().await;
}

async fn tenants_never_see_each_others_results<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let leases = store.leases();
    let tenants = [
        "acme",
        "acme ",
        "ACME",
        "acm\u{e9}",
        "acme\u{301}",
        "acme\u{200f}",
        "'; DROP TABLE x; --",
    ];
    let scopes = std::iter::once(Scope::none()).chain(tenants.map(|t| Scope::new(t).unwrap()));
    let ids: Vec<_> = scopes
        .map(|scope| Identity::new(scope, Consumer::new("billing").unwrap(), key("order:1")))
        .collect();
    let lease_for = Duration::from_secs(60);
    let print = Fingerprint::of(b"p");
    let result_of = |id: &Identity| format!("receipt for {:?}", id.scope.as_str()).into_bytes();
    for id in &ids {
        match leases.claim_lease(id, &print, lease_for).await.unwrap() {
            LeaseClaim::Acquired(lease) => leases.complete(&lease, &result_of(id)).await.unwrap(),
            other => panic!("{:?} saw another tenant's key: {other:?}", id.scope),
        }
    }
    for id in &ids {
        assert_eq!(
            leases.claim_lease(id, &print, lease_for).await.unwrap(),
            LeaseClaim::Done {
                result: Some(result_of(id))
            },
            "{:?}",
            id.scope
        );
    }
    store.close().await;
}
