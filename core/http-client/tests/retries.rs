//! The retry loop against real sockets on 127.0.0.1: a raw HTTP/1.1 server (one thread per
//! connection, `Connection: close`) that answers each request as a script says, or stalls, and
//! a port nobody listens on. Checks what each policy retries and the waits in between.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::header::{HeaderValue, AUTHORIZATION};
use reqwest::Url;
use rlhf_http_client::{Client, Error, Invalid, Options, Outcome, Problem, RetryOn, RetryPolicy};

/// What the server does with request number `n` (0-based).
enum Answer {
    /// Status, extra header lines (`Name: value\r\n` each) and body.
    Reply(u16, &'static str, String),
    /// Reads the request and never answers (holds the connection for 30 s).
    Stall,
}

struct Server {
    addr: SocketAddr,
    /// The head of each request received (request line and headers), in arrival order.
    heads: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(script: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (log, script, count) = (Arc::clone(&heads), Arc::new(script), Arc::new(AtomicUsize::new(0)));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (log, script, count) = (Arc::clone(&log), Arc::clone(&script), Arc::clone(&count));
                std::thread::spawn(move || {
                    let Some(head) = read_request(&stream) else { return };
                    log.lock().unwrap().push(head);
                    answer(stream, script(count.fetch_add(1, Ordering::SeqCst)));
                });
            }
        });
        Server { addr, heads }
    }

    fn url(&self) -> Url {
        Url::parse(&format!("http://{}/api", self.addr)).unwrap()
    }

    fn requests(&self) -> usize {
        self.heads.lock().unwrap().len()
    }
}

/// Reads one request (head and `Content-Length` body); its head, lowercased.
fn read_request(stream: &TcpStream) -> Option<String> {
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line.to_lowercase());
    }
    let len = head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some(head)
}

fn answer(mut stream: TcpStream, answer: Answer) {
    match answer {
        Answer::Reply(status, headers, body) => {
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n{headers}\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(body.as_bytes());
        }
        Answer::Stall => std::thread::sleep(Duration::from_secs(30)),
    }
}

fn ok() -> Answer {
    Answer::Reply(200, "", r#"{"value": 7}"#.into())
}

fn status(code: u16) -> Answer {
    Answer::Reply(code, "", format!("status {code}"))
}

/// A port with nothing listening on it.
fn closed_port_url() -> Url {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    Url::parse(&format!("http://127.0.0.1:{port}/api")).unwrap()
}

fn options(retry_on: RetryOn, retries: u32) -> Options {
    Options {
        user_agent: "rlhf-http-client-test".into(),
        connect_timeout: Duration::from_secs(2),
        timeout: Duration::from_millis(300),
        max_response_bytes: 1 << 20,
        auth: None,
        retry: RetryPolicy {
            retries,
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(8),
            retry_on,
            honour_retry_after: false,
        },
        describe: Problem::of,
    }
}

/// The `value` field of `{"value": <number>}`.
fn parse(body: &[u8]) -> Result<u64, Invalid> {
    let text = std::str::from_utf8(body).map_err(|e| Invalid::Json(e.to_string()))?;
    let digits = text.trim().strip_prefix(r#"{"value": "#).and_then(|t| t.strip_suffix('}'));
    let digits = digits.ok_or_else(|| Invalid::Json(format!("not the expected JSON: {text}")))?;
    digits.parse().map_err(|_| Invalid::Shape(format!("`value` is not a number: {digits}")))
}

fn post(options: Options, url: &Url, abort: Option<&AtomicBool>) -> Outcome<u64> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = Client::new(options).unwrap();
    runtime.block_on(client.post(url, br#"{"q": 1}"#, abort, parse))
}

fn failure(outcome: &Outcome<u64>) -> String {
    match &outcome.result {
        Err(f) => f.to_string(),
        Ok(v) => panic!("expected a failure, got {v}"),
    }
}

#[test]
fn server_errors_are_retried_by_both_policies() {
    for retry_on in [RetryOn::AnyFailure, RetryOn::Unapplied] {
        let server = Server::start(|n| if n < 2 { status(if n == 0 { 500 } else { 503 }) } else { ok() });
        let out = post(options(retry_on, 3), &server.url(), None);
        assert_eq!(out.result, Ok(7), "{retry_on:?}");
        assert_eq!((out.attempts, out.latencies.len(), server.requests()), (3, 3, 3), "{retry_on:?}");
    }
}

#[test]
fn a_timeout_is_retried_only_when_the_policy_allows() {
    let server = Server::start(|_| Answer::Stall);
    let url = server.url();
    let out = post(options(RetryOn::AnyFailure, 2), &url, None);
    assert_eq!(failure(&out), format!("{url}: timeout (no complete response within 0.3 s) after 3 attempts"));
    assert_eq!(server.requests(), 3);
    assert!(out.latencies.iter().all(|&l| (0.3..1.5).contains(&l)), "{:?}", out.latencies);

    // The request reached the server, which may have applied it: it is not sent again.
    let server = Server::start(|_| Answer::Stall);
    let url = server.url();
    let t = Instant::now();
    let out = post(options(RetryOn::Unapplied, 2), &url, None);
    assert_eq!(failure(&out), format!("{url}: timeout (no complete response within 0.3 s) after 1 attempt"));
    assert_eq!((out.attempts, server.requests()), (1, 1));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn a_refused_connection_is_retried_by_both_policies() {
    let url = closed_port_url();
    for retry_on in [RetryOn::AnyFailure, RetryOn::Unapplied] {
        let out = post(options(retry_on, 2), &url, None);
        let msg = failure(&out);
        assert!(msg.starts_with(&format!("{url}: cannot connect after 3 attempts: ")), "{msg}");
        assert_eq!(out.attempts, 3);
    }
}

#[test]
fn other_failures_are_final_for_the_cautious_policy_only() {
    type Script = fn(usize) -> Answer;
    let cases: [(Script, &str); 4] = [
        (|_| status(404), "HTTP 404 after {n}: status 404"),
        (
            |_| Answer::Reply(200, "", "<html>".into()),
            "invalid JSON after {n}: not the expected JSON: <html>; body: <html>",
        ),
        (
            |_| Answer::Reply(200, "", r#"{"value": x}"#.into()),
            "invalid response after {n}: `value` is not a number: x",
        ),
        (|_| Answer::Reply(200, "", "y".repeat(2 << 20)), "response too large after {n}: over 1048576 bytes"),
    ];
    for (script, want) in cases {
        for (retry_on, attempts, n) in [(RetryOn::Unapplied, 1, "1 attempt"), (RetryOn::AnyFailure, 3, "3 attempts")] {
            let server = Server::start(script);
            let out = post(options(retry_on, 2), &server.url(), None);
            assert_eq!(failure(&out), format!("{}: {}", server.url(), want.replace("{n}", n)), "{retry_on:?}");
            assert_eq!((out.attempts, server.requests()), (attempts, attempts as usize), "{want}");
        }
    }
    // 429 is the server refusing the request: retried, and its Retry-After honoured when asked.
    let server = Server::start(|n| if n == 0 { Answer::Reply(429, "retry-after: 1\r\n", String::new()) } else { ok() });
    let opts = Options {
        retry: RetryPolicy { honour_retry_after: true, ..options(RetryOn::Unapplied, 1).retry },
        ..options(RetryOn::Unapplied, 1)
    };
    let t = Instant::now();
    assert_eq!(post(opts, &server.url(), None).result, Ok(7));
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
}

#[test]
fn backoff_doubles_between_attempts() {
    let server = Server::start(|_| status(500));
    let mut opts = options(RetryOn::AnyFailure, 3);
    opts.retry.backoff = Duration::from_millis(100);
    let t = Instant::now();
    let out = post(opts, &server.url(), None);
    // 0.1 + 0.2 + 0.4 s of waits.
    assert!(t.elapsed() >= Duration::from_millis(700), "{:?}", t.elapsed());
    assert_eq!(out.attempts, 4);
    assert!(failure(&out).ends_with("HTTP 500 after 4 attempts: status 500"));
}

#[test]
fn an_abort_stops_retrying() {
    let server = Server::start(|_| status(500));
    let abort = AtomicBool::new(true);
    let out = post(options(RetryOn::AnyFailure, 3), &server.url(), Some(&abort));
    assert_eq!((out.attempts, server.requests()), (1, 1));
    assert!(failure(&out).ends_with("HTTP 500 after 1 attempt: status 500"));
}

#[test]
fn headers_and_the_callers_wording() {
    let server = Server::start(|n| if n == 0 { status(502) } else { ok() });
    let mut opts = options(RetryOn::AnyFailure, 1);
    let mut token = HeaderValue::from_static("Bearer s3cret");
    token.set_sensitive(true);
    opts.auth = Some((AUTHORIZATION, token));
    assert!(!format!("{opts:?}").contains("s3cret"));
    assert_eq!(post(opts, &server.url(), None).result, Ok(7));
    let heads = server.heads.lock().unwrap().clone();
    for head in &heads {
        assert!(head.starts_with("post /api http/1.1\r\n"), "{head}");
        for line in ["authorization: bearer s3cret", "content-type: application/json", "accept: application/json"] {
            assert!(head.contains(line), "{line}: {head}");
        }
        assert!(head.contains("user-agent: rlhf-http-client-test"), "{head}");
    }

    fn worded(e: &Error) -> Problem {
        match e {
            Error::Connect(d) => Problem::new("request failed", Some(d.clone())),
            e => Problem::of(e),
        }
    }
    let url = closed_port_url();
    let out = post(Options { describe: worded, ..options(RetryOn::Unapplied, 0) }, &url, None);
    assert!(failure(&out).starts_with(&format!("{url}: request failed after 1 attempt: ")));
}
