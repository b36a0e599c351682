//! A loopback TCP proxy the tests can cut and restore, to make PostgreSQL or Redis unreachable
//! for the nodes without touching the shared services.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    /// While true, connections stay open but nothing is forwarded: a half-open link.
    frozen: watch::Sender<bool>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let (frozen, frozen_rx) = watch::channel(false);
        let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (u, c, target) = (up.clone(), conns.clone(), target.to_string());
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if !u.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let (target, f1, f2) = (target.clone(), frozen_rx.clone(), frozen_rx.clone());
                let task = tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(&target).await {
                        let (ir, iw) = inbound.into_split();
                        let (or, ow) = outbound.into_split();
                        tokio::join!(pump(ir, ow, f1), pump(or, iw, f2));
                    }
                });
                c.lock().unwrap().push(task.abort_handle());
            }
        });
        Proxy {
            port,
            up,
            frozen,
            conns,
            accept,
        }
    }

    /// Stops forwarding in both directions without closing anything (a half-open link).
    pub fn freeze(&self) {
        let _ = self.frozen.send(true);
    }

    pub fn thaw(&self) {
        let _ = self.frozen.send(false);
    }

    /// Drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Copies one direction, holding the bytes while the link is frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while *frozen.borrow_and_update() {
            if frozen.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
