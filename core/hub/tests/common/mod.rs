//! A loopback HTTP/1.1 server for the Hub client's tests: each request is answered by a closure
//! the test gives (a hostile Hub says whatever it likes), every request is logged with its
//! `Authorization` header, and a reply may trickle its body a byte at a time. One thread per
//! connection, `Connection: close`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// The raw path, percent-encoding kept.
    pub path: String,
    pub authorization: Option<String>,
}

/// What to answer.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Send the body one byte per this long (its Content-Length declared up front).
    pub trickle: Option<Duration>,
}

impl Reply {
    pub fn new(status: u16) -> Self {
        Reply { status, ..Default::default() }
    }

    pub fn header(mut self, k: &str, v: impl ToString) -> Self {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }

    pub fn body(mut self, b: impl Into<Vec<u8>>) -> Self {
        self.body = b.into();
        self
    }

    pub fn json(v: serde_json::Value) -> Self {
        Reply::new(200).header("content-type", "application/json").body(v.to_string())
    }
}

type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

/// A running server; it lives as long as the test process (its threads end with it).
pub struct Server {
    pub addr: SocketAddr,
    pub log: Arc<Mutex<Vec<Request>>>,
}

impl Server {
    /// Serves on `listener` with `handler`.
    pub fn on(listener: TcpListener, handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> Server {
        let addr = listener.local_addr().unwrap();
        let log: Arc<Mutex<Vec<Request>>> = Arc::default();
        let handler: Arc<Handler> = Arc::new(handler);
        let shared = log.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (log, handler) = (shared.clone(), handler.clone());
                std::thread::spawn(move || serve(stream, &log, &*handler));
            }
        });
        Server { addr, log }
    }

    /// Serves on `ip`, any free port.
    pub fn start(ip: &str, handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> Server {
        Server::on(TcpListener::bind((ip, 0)).unwrap(), handler)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Request> {
        self.log.lock().unwrap().clone()
    }
}

fn serve(stream: TcpStream, log: &Mutex<Vec<Request>>, handler: &Handler) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    let mut authorization = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("authorization") {
                authorization = Some(v.trim().to_string());
            }
        }
    }
    let req = Request { method, path, authorization };
    log.lock().unwrap().push(req.clone());
    let reply = handler(&req);
    let mut out = stream;
    let mut head = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", reply.status);
    let declared = reply.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-length"));
    for (k, v) in &reply.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !declared {
        head.push_str(&format!("Content-Length: {}\r\n", reply.body.len()));
    }
    head.push_str("\r\n");
    if out.write_all(head.as_bytes()).is_err() || req.method == "HEAD" {
        return;
    }
    match reply.trickle {
        None => {
            let _ = out.write_all(&reply.body);
        }
        Some(every) => {
            for b in &reply.body {
                if out.write_all(&[*b]).and_then(|_| out.flush()).is_err() {
                    return;
                }
                std::thread::sleep(every);
            }
        }
    }
}

/// Runs `f` on a thread and waits up to `secs` for it: a hang fails the test instead of holding it.
pub fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("still running after {secs} s: it hangs"))
}

/// Every entry below `dir` (relative paths, sorted), symlinks not followed.
pub fn tree(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(base).unwrap().to_string_lossy().to_string());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&p, base, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// A content hash standing in for the sha256 the Hub sends as an LFS file's ETag.
pub fn etag(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h = (h ^ u64::from(*b)).wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}{:08x}", bytes.len())
}
