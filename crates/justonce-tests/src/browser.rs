//! A headless Chromium driven over WebDriver (JSON over HTTP) by a chromedriver of the
//! test's own, on a free port, with a fresh profile. Elements are named by CSS selector at
//! each call, so that a page that re-renders never leaves a test holding a stale element.

use base64::Engine;
use serde_json::{Value, json};
use std::future::Future;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a page may take to show what a test waits for: two shared cores run the
/// browser, the service and the test.
const WAIT: Duration = Duration::from_secs(60);

/// Chromium's flags: headless as root, and nothing that reaches the internet, which is
/// refused on test machines.
const CHROMIUM_FLAGS: [&str; 11] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--window-size=1280,1024",
];

/// The W3C name of the member that holds an element's reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session; dropping it ends the session, its chromedriver and its profile.
pub struct Browser {
    http: reqwest::Client,
    driver: Child,
    port: u16,
    session: String,
    profile: PathBuf,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium. Panics, naming the package, when
    /// either is not installed.
    pub async fn start() -> Self {
        let chromium = installed("chromium", "chromium");
        let chromedriver = installed("chromedriver", "chromium-driver");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port for chromedriver")
            .port();
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", chromedriver.display()));
        let profile = std::env::temp_dir().join(format!("justonce-chromium-{}", crate::unique()));
        // reqwest asks for a TLS provider even to speak plain HTTP.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut browser = Self {
            http: reqwest::Client::new(),
            driver,
            port,
            session: String::new(),
            profile,
        };
        wait_until("chromedriver to answer", || browser.driver_ready()).await;
        let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|&flag| flag.to_owned()).collect();
        args.push(format!("--user-data-dir={}", browser.profile.display()));
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            // A confirm() stays open until the test answers it.
            "unhandledPromptBehavior": "ignore",
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let created = browser
            .send(
                reqwest::Method::POST,
                "/session".to_owned(),
                Some(capabilities),
            )
            .await
            .unwrap_or_else(|e| panic!("chromedriver could not start Chromium: {e}"));
        browser.session = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a new session without an id: {created}"))
            .to_owned();
        browser
    }

    /// Opens `url` and returns once it has loaded.
    pub async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
    }

    /// The address of the page shown.
    pub async fn url(&self) -> String {
        let url = self.get("/url").await.expect("the page's address");
        url.as_str().unwrap_or_default().to_owned()
    }

    /// Clicks the first element that `css` matches.
    pub async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{element}/click"),
            json!({}),
        )
        .await
        .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Empties the field `css` matches and types `text` into it, as keys.
    pub async fn type_into(&self, css: &str, text: &str) {
        let element = self.find(css).await;
        let path = format!("/element/{element}");
        self.command(reqwest::Method::POST, &format!("{path}/clear"), json!({}))
            .await
            .unwrap_or_else(|e| panic!("clear {css}: {e}"));
        self.command(
            reqwest::Method::POST,
            &format!("{path}/value"),
            json!({ "text": text }),
        )
        .await
        .unwrap_or_else(|e| panic!("type into {css}: {e}"));
    }

    /// The text shown by the first element `css` matches, or why there is none.
    pub async fn text(&self, css: &str) -> Result<String, String> {
        let element = self.try_find(css).await?;
        let text = self.get(&format!("/element/{element}/text")).await?;
        Ok(text.as_str().unwrap_or_default().to_owned())
    }

    /// An attribute of the first element `css` matches, or why there is none.
    pub async fn attribute(&self, css: &str, name: &str) -> Result<Option<String>, String> {
        let element = self.try_find(css).await?;
        let value = self
            .get(&format!("/element/{element}/attribute/{name}"))
            .await?;
        Ok(value.as_str().map(str::to_owned))
    }

    /// How many elements `css` matches.
    pub async fn count(&self, css: &str) -> usize {
        let found = self
            .command(
                reqwest::Method::POST,
                "/elements",
                json!({"using": "css selector", "value": css}),
            )
            .await
            .unwrap_or_else(|e| panic!("find {css}: {e}"));
        found.as_array().map_or(0, Vec::len)
    }

    /// Runs `script` as the body of a function given `args`, and returns what it returns
    /// (a promise is awaited).
    pub async fn execute(&self, script: &str, args: Value) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            json!({ "script": script, "args": args }),
        )
        .await
        .unwrap_or_else(|e| panic!("script {script}: {e}"))
    }

    /// The text of the open alert or confirm dialog, or why there is none.
    pub async fn dialog_text(&self) -> Result<String, String> {
        let text = self.get("/alert/text").await?;
        Ok(text.as_str().unwrap_or_default().to_owned())
    }

    /// Answers the open alert or confirm dialog with OK.
    pub async fn accept_dialog(&self) {
        self.command(reqwest::Method::POST, "/alert/accept", json!({}))
            .await
            .unwrap_or_else(|e| panic!("accept the dialog: {e}"));
    }

    /// Writes a PNG of the page as shown to `path`, whole or not at all: tests running
    /// at once may write the same screenshot.
    pub async fn screenshot(&self, path: &Path) {
        let encoded = self.get("/screenshot").await.expect("a screenshot");
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().unwrap_or_default())
            .expect("a screenshot in base64");
        let partial = path.with_extension(format!("{}.part", crate::unique()));
        std::fs::write(&partial, png)
            .and_then(|()| std::fs::rename(&partial, path))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }

    /// The reference of the first element `css` matches; panics naming the page when none.
    async fn find(&self, css: &str) -> String {
        match self.try_find(css).await {
            Ok(element) => element,
            Err(e) => panic!("{e} on {}", self.url().await),
        }
    }

    async fn try_find(&self, css: &str) -> Result<String, String> {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await
            .map_err(|e| format!("{css}: {e}"))?;
        found[ELEMENT]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{css}: an element without a reference: {found}"))
    }

    async fn get(&self, path: &str) -> Result<Value, String> {
        let path = format!("/session/{}{path}", self.session);
        self.send(reqwest::Method::GET, path, None).await
    }

    async fn command(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> Result<Value, String> {
        let path = format!("/session/{}{path}", self.session);
        self.send(method, path, Some(body)).await
    }

    /// One WebDriver request: its `value`, or the error it names. Panics when chromedriver
    /// does not answer at all.
    async fn send(
        &self,
        method: reqwest::Method,
        path: String,
        body: Option<Value>,
    ) -> Result<Value, String> {
        let mut request = self
            .http
            .request(method, format!("http://127.0.0.1:{}{path}", self.port))
            .timeout(WAIT);
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("chromedriver {path}: {e}"));
        let status = response.status();
        let text = response
            .text()
            .await
            .unwrap_or_else(|e| panic!("chromedriver {path}: {e}"));
        let mut answer: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("chromedriver {path} answered {status} {text}: {e}"));
        let value = answer["value"].take();
        if status.is_success() {
            Ok(value)
        } else {
            Err(format!("{}: {}", value["error"], value["message"]))
        }
    }

    async fn driver_ready(&self) -> Result<(), String> {
        let status = self
            .http
            .get(format!("http://127.0.0.1:{}/status", self.port))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let text = status.text().await.map_err(|e| e.to_string())?;
        let ready = serde_json::from_str::<Value>(&text)
            .is_ok_and(|status| status["value"]["ready"] == true);
        if ready { Ok(()) } else { Err(text) }
    }

    /// Ends the session so that Chromium and its helpers exit; a blocking request, since a
    /// drop cannot await. chromedriver answers once the session has ended, and keeps the
    /// connection open whatever it was asked: the first bytes of the answer are enough.
    fn end_session(&self) -> std::io::Result<()> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(WAIT))?;
        write!(
            stream,
            "DELETE /session/{} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\r\n",
            self.session, self.port
        )?;
        stream.read(&mut [0; 64]).map(drop)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.end_session();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// The path of `program` on `PATH`; panics naming the Debian package that installs it.
fn installed(program: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|folder| folder.join(program))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{program} is not installed: the browser tests need Debian's {package} \
                 (scripts/services installs it)"
            )
        })
}

/// Asks `check` again until it gives a value, for at most a minute; then fails with what
/// it saw last.
pub async fn wait_until<T, F>(what: &str, mut check: impl FnMut() -> F) -> T
where
    F: Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(seen) if tokio::time::Instant::now() >= deadline => {
                panic!("waited {WAIT:?} for {what}; saw last: {seen}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
