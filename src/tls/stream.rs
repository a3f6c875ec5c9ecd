//! A client connection as the servers read and write it: the socket, or the
//! TLS session over it. hyper serves it (see `serve::connection`), and so
//! does tonic for the gRPC listener.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The client's socket, or the TLS session over it.
pub enum ClientStream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS; boxed, a session's state is large next to a plain socket.
    Tls(Box<TlsStream<TcpStream>>),
}

impl ClientStream {
    /// Bytes written to the socket that the client has not yet taken
    /// (Linux's `SIOCOUTQ`: sent and not acknowledged, or not yet sent);
    /// `None` where that cannot be read.
    pub fn unsent(&self) -> Option<u32> {
        use std::os::fd::AsRawFd;
        let fd = match self {
            ClientStream::Plain(s) => s.as_raw_fd(),
            ClientStream::Tls(s) => s.get_ref().0.as_raw_fd(),
        };
        let mut n: libc::c_int = 0;
        // SAFETY: TIOCOUTQ writes one int through the pointer, which points
        // at `n`; the descriptor is the live socket this stream owns.
        let done = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
        (done == 0).then(|| u32::try_from(n).ok()).flatten()
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientStream::Plain(s) => s.is_write_vectored(),
            ClientStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Connected for ClientStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            ClientStream::Plain(s) => s.connect_info(),
            ClientStream::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}
