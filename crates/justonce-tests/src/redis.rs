//! A test's own keys on the real Redis server.

use justonce_core::Retention;
use justonce_redis::RedisLeases;

/// The Redis server the tests use; they fail if it is down.
pub fn redis_url() -> String {
    std::env::var("JUSTONCE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// One test's keys, under a prefix no other test uses.
pub struct TestRedis {
    /// The lease store, writing under [`TestRedis::prefix`].
    pub leases: RedisLeases,
    /// The prefix of this test's Redis keys.
    pub prefix: String,
    client: redis::Client,
}

impl TestRedis {
    /// A lease store with this test's prefix, keeping keys for the default retention.
    pub async fn new(test: &str) -> Self {
        let prefix = format!("justonce-test:{}:{test}:", crate::unique());
        let url = redis_url();
        let leases = RedisLeases::connect(&url, Retention::default())
            .await
            .unwrap_or_else(|e| panic!("Redis at {url}: {e}"))
            .prefix(&prefix);
        let client = redis::Client::open(url).expect("a Redis URL");
        Self {
            leases,
            prefix,
            client,
        }
    }

    /// Deletes this test's keys.
    pub async fn cleanup(self) {
        let mut connection = self
            .client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut connection)
            .await
            .expect("KEYS");
        if !keys.is_empty() {
            let _: () = redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut connection)
                .await
                .expect("DEL");
        }
    }
}
