//! The floor of a proxied GET through tokio on this machine: a proxy that
//! decides nothing and rewrites nothing, built as tollgate's proxy is (one
//! current-thread runtime per thread, each with its own `SO_REUSEPORT`
//! listener, `TCP_NODELAY` both ways, heads parsed by httparse), moving a
//! body-less request's head to the upstream as it came and the answer back
//! as it came. `bench/run` times it with wrk beside NGINX `proxy_pass` and
//! tollgate, so what any proxy on tokio pays here for the sockets, the
//! runtime and the two parses is measured rather than assumed: the part of
//! the gap to NGINX that is not tollgate's own work.
//!
//! It serves only what the benchmark sends (GETs with no body, answers
//! framed by `Content-Length`) and closes a connection on anything else.
//!
//! `cargo run --release --example proxy_floor -- LISTEN UPSTREAM [THREADS]`
//! (serves until killed; THREADS defaults to the cores, as tollgate's
//! `--proxy-threads`)

use std::net::SocketAddr;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Most header fields a head may have.
const FIELDS: usize = 64;

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: proxy_floor LISTEN UPSTREAM [THREADS]";
    let listen: SocketAddr = args.next().expect(usage).parse().expect("LISTEN: an address");
    let upstream: SocketAddr = args.next().expect(usage).parse().expect("UPSTREAM: an address");
    let threads = args.next().map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |n| n.parse().expect("THREADS: a number"),
    );
    let workers: Vec<_> = (0..threads)
        .map(|_| std::thread::spawn(move || serve_thread(listen, upstream)))
        .collect();
    for worker in workers {
        let _ = worker.join();
    }
}

/// One thread's runtime and listener, serving its connections until killed.
fn serve_thread(listen: SocketAddr, upstream: SocketAddr) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let socket = TcpSocket::new_v4().expect("socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        socket.set_reuseport(true).expect("SO_REUSEPORT");
        socket.bind(listen).expect("bind");
        let listener = socket.listen(1024).expect("listen");
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            tokio::spawn(async move {
                let _ = relay(client, upstream).await;
            });
        }
    });
}

/// Serves one client connection: each request head goes to the upstream
/// connection it keeps, each answer back, until either side closes or
/// sends what the floor does not serve.
async fn relay(mut client: TcpStream, upstream_addr: SocketAddr) -> std::io::Result<()> {
    let mut upstream: Option<TcpStream> = None;
    let mut from_client = BytesMut::with_capacity(4096);
    let mut from_upstream = BytesMut::with_capacity(4096);
    loop {
        let head_len = loop {
            if let Some(len) = request_head(&from_client)? {
                break len;
            }
            if client.read_buf(&mut from_client).await? == 0 {
                return Ok(());
            }
        };
        let head = from_client.split_to(head_len);
        let up = match &mut upstream {
            Some(up) => up,
            None => {
                let up = TcpStream::connect(upstream_addr).await?;
                up.set_nodelay(true)?;
                upstream.insert(up)
            }
        };
        up.write_all(&head).await?;
        let whole = loop {
            if let Some(whole) = response_len(&from_upstream)?
                && from_upstream.len() >= whole
            {
                break whole;
            }
            if up.read_buf(&mut from_upstream).await? == 0 {
                return Err(std::io::Error::other("upstream closed"));
            }
        };
        client.write_all(&from_upstream[..whole]).await?;
        from_upstream.advance(whole);
    }
}

/// The length of the body-less request head at the start of `buf`, once
/// whole; an error for one with a body.
fn request_head(buf: &[u8]) -> std::io::Result<Option<usize>> {
    let mut fields = [httparse::EMPTY_HEADER; FIELDS];
    let mut req = httparse::Request::new(&mut fields);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => {
            let framed = req.headers.iter().any(|h| {
                h.name.eq_ignore_ascii_case("content-length") || h.name.eq_ignore_ascii_case("transfer-encoding")
            });
            if framed {
                return Err(std::io::Error::other("the floor serves no request body"));
            }
            Ok(Some(len))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(std::io::Error::other(e)),
    }
}

/// The length of the whole answer (head and `Content-Length` body) at the
/// start of `buf`, once its head is whole.
fn response_len(buf: &[u8]) -> std::io::Result<Option<usize>> {
    let mut fields = [httparse::EMPTY_HEADER; FIELDS];
    let mut res = httparse::Response::new(&mut fields);
    match res.parse(buf) {
        Ok(httparse::Status::Complete(len)) => {
            let body = res
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse::<usize>().ok())
                .ok_or_else(|| std::io::Error::other("the floor serves only answers with a Content-Length"))?;
            Ok(Some(len.saturating_add(body)))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(std::io::Error::other(e)),
    }
}
