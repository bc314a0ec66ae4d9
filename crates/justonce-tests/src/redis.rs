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

/// A TCP proxy to the Redis server whose connections are broken, and new ones refused,
/// while it is down: the server going away and coming back, as a client sees it, without
/// touching the server the other tests share.
pub struct BreakableRedis {
    port: u16,
    up: tokio::sync::watch::Sender<bool>,
}

impl BreakableRedis {
    /// Listens on a free port, up.
    pub async fn start() -> Self {
        let upstream = redis_url().trim_start_matches("redis://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let port = listener.local_addr().expect("its address").port();
        let up = tokio::sync::watch::Sender::new(true);
        let state = up.subscribe();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !*state.borrow() {
                    continue; // dropping `client` refuses it
                }
                let (upstream, mut down) = (upstream.clone(), state.clone());
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = down.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Self { port, up }
    }

    /// The URL that reaches Redis through it.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Down breaks every connection and refuses new ones; up forwards them again.
    pub fn set_up(&self, up: bool) {
        self.up.send_replace(up);
    }
}
