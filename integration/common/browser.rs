//! A real headless Chromium, driven over WebDriver (Debian's `chromium` and
//! `chromium-driver`, installed by the test command), for the tests that use
//! the operator page as a person would.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use serde_json::{Value as Json, json};

use super::{client, free_port, send};

/// WebDriver's key for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One chromedriver and one browser session.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium `width` x `height`.
    pub async fn start(width: u32, height: u32) -> Browser {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            // Its own process group, so Chromium goes with it whatever happens.
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver must be installed (the test command installs chromium-driver)");
        let base = format!("http://{}", SocketAddr::from(([127, 0, 0, 1], port)));
        let mut browser = Browser {
            driver,
            base,
            session: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = tokio::time::timeout(Duration::from_secs(2), async {
                let c = client();
                let req = http::Request::get(format!("{}/status", browser.base))
                    .body(http_body_util::Full::new(Bytes::new()))
                    .unwrap();
                c.request(req).await.is_ok()
            })
            .await
            .unwrap_or(false);
            if ready {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         format!("--window-size={width},{height}")],
            },
        }}});
        let answer = browser.call(Method::POST, "/session", caps).await;
        browser.session = answer["sessionId"].as_str().expect("a session").to_string();
        browser
    }

    async fn call(&self, method: Method, path: &str, body: Json) -> Json {
        let body = match method {
            Method::GET | Method::DELETE => Vec::new(),
            _ => serde_json::to_vec(&body).unwrap(),
        };
        let answer = send(
            &client(),
            method,
            &format!("{}{path}", self.base),
            &[("content-type", "application/json")],
            body,
        )
        .await;
        let json = answer.json();
        assert!(answer.status.is_success(), "webdriver {path}: {json}");
        json["value"].clone()
    }

    async fn session_call(&self, method: Method, path: &str, body: Json) -> Json {
        self.call(method, &format!("/session/{}{path}", self.session), body)
            .await
    }

    /// Loads `url`.
    pub async fn open(&self, url: &str) {
        self.session_call(Method::POST, "/url", json!({ "url": url })).await;
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page.
    pub async fn run(&self, script: &str, args: Json) -> Json {
        self.session_call(Method::POST, "/execute/sync", json!({ "script": script, "args": args }))
            .await
    }

    /// Waits until `script` returns something truthy, and returns it.
    pub async fn wait_for(&self, what: &str, script: &str) -> Json {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let got = self.run(script, json!([])).await;
            let truthy = match &got {
                Json::Null | Json::Bool(false) => false,
                Json::String(s) => !s.is_empty(),
                Json::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return got;
            }
            assert!(Instant::now() < deadline, "waited 20 s for {what}; last saw {got}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The element `css` selects (it must exist).
    pub async fn find(&self, css: &str) -> String {
        let found = self
            .session_call(Method::POST, "/element", json!({"using": "css selector", "value": css}))
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}"))
            .to_string()
    }

    /// Clicks what `css` selects.
    pub async fn click(&self, css: &str) {
        let el = self.find(css).await;
        self.session_call(Method::POST, &format!("/element/{el}/click"), json!({}))
            .await;
    }

    /// Replaces the text of the field `css` selects by typing `text`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css).await;
        self.session_call(Method::POST, &format!("/element/{el}/clear"), json!({}))
            .await;
        self.session_call(Method::POST, &format!("/element/{el}/value"), json!({ "text": text }))
            .await;
    }

    /// The visible text of what `css` selects.
    pub async fn text(&self, css: &str) -> String {
        let el = self.find(css).await;
        self.session_call(Method::GET, &format!("/element/{el}/text"), Json::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> Vec<u8> {
        let b64 = self.session_call(Method::GET, "/screenshot", Json::Null).await;
        decode_base64(b64.as_str().unwrap_or_default())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The driver and every Chromium process it started.
        if let Ok(pid) = i32::try_from(self.driver.id()) {
            // SAFETY: a plain kill(2) of the group this test started.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for v in text.bytes().filter_map(value) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
