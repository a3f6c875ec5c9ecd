//! An HTTP/2 upstream's stream resets, read so that a cut response reads
//! as cut.
//!
//! A server may reset a stream with NO_ERROR once its response is complete
//! (RFC 9113 §8.1: "stop sending the request body"). hyper reads every
//! NO_ERROR reset as a body's clean end, even one that comes before the
//! stream's end, so a response the upstream abandoned midway (Node's
//! `stream.close()` does this) would reach the client as if whole: with no
//! `Content-Length`, an HTTP/1.1 client gets the closing chunk, an HTTP/2
//! client END_STREAM. NGINX and Envoy take any reset before the stream's
//! end for a failure. The frames the upstream sends pass through
//! [`ResetsAsErrors`], which makes a NO_ERROR reset read as CANCEL: before
//! the stream's end the body then fails, and the client's response is cut
//! as for a closed connection; after it, h2 keeps the response whole
//! whatever the code, and only the upload hyper was still sending stops
//! (as it would anyway).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// RST_STREAM's frame type.
const RST_STREAM: u8 = 0x3;

/// The CANCEL error code's last byte (its others are zero, as NO_ERROR's).
const CANCEL: u8 = 0x8;

/// Where the reader stands in the upstream's frames.
#[derive(Debug, Clone, Copy, PartialEq)]
enum At {
    /// In a frame header, with this many of its 9 bytes seen.
    Header(usize),
    /// In a payload with this many bytes left; `code` counts the zero bytes
    /// of a RST_STREAM's error code seen so far (`None`: another frame, or
    /// a code that is not NO_ERROR).
    Payload { left: usize, code: Option<u8> },
}

/// The frame reader's state, apart from the bytes it reads.
#[derive(Debug)]
struct Frames {
    at: At,
    header: [u8; 9],
}

impl Frames {
    fn new() -> Self {
        Frames {
            at: At::Header(0),
            header: [0; 9],
        }
    }

    /// Reads `bytes`, just received, rewriting a NO_ERROR reset's code.
    fn pass(&mut self, bytes: &mut [u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            match self.at {
                At::Header(seen) => {
                    let take = 9usize.saturating_sub(seen).min(rest.len());
                    let (now, after) = std::mem::take(&mut rest).split_at_mut(take);
                    let seen_now = seen.saturating_add(take);
                    if let Some(slot) = self.header.get_mut(seen..seen_now) {
                        slot.copy_from_slice(now);
                    }
                    rest = after;
                    self.at = if seen_now == 9 { self.payload() } else { At::Header(seen_now) };
                }
                At::Payload { left: 0, .. } => self.at = At::Header(0),
                At::Payload { left, code: Some(zeros) } => {
                    let Some((byte, after)) = std::mem::take(&mut rest).split_first_mut() else {
                        break;
                    };
                    let code = match (*byte, zeros) {
                        (0, 3) => {
                            *byte = CANCEL;
                            None
                        }
                        (0, n) => Some(n.saturating_add(1)),
                        _ => None,
                    };
                    rest = after;
                    self.at = At::Payload {
                        left: left.saturating_sub(1),
                        code,
                    };
                }
                At::Payload { left, code: None } => {
                    let take = left.min(rest.len());
                    rest = std::mem::take(&mut rest).get_mut(take..).unwrap_or_default();
                    self.at = At::Payload {
                        left: left.saturating_sub(take),
                        code: None,
                    };
                }
            }
        }
        if self.at == (At::Payload { left: 0, code: None }) {
            self.at = At::Header(0);
        }
    }

    /// The payload after the header just read.
    fn payload(&self) -> At {
        let [l0, l1, l2, kind, ..] = self.header;
        let left = usize::try_from(u32::from_be_bytes([0, l0, l1, l2])).unwrap_or(usize::MAX);
        let code = (kind == RST_STREAM && left == 4).then_some(0);
        At::Payload { left, code }
    }
}

/// An HTTP/2 upstream connection whose NO_ERROR stream resets read as
/// CANCEL (see the module's doc).
pub struct ResetsAsErrors<T> {
    io: T,
    frames: Frames,
}

impl<T> ResetsAsErrors<T> {
    /// Reads `io`'s frames as they pass.
    pub fn new(io: T) -> Self {
        ResetsAsErrors { io, frames: Frames::new() }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ResetsAsErrors<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some(new) = buf.filled_mut().get_mut(before..) {
            this.frames.pass(new);
        }
        read
    }
}

writes_through!(ResetsAsErrors);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Frames a server might send, each a NO_ERROR reset's twin in length
    /// or code, so that a misread frame boundary would show.
    fn sample() -> (Vec<u8>, Vec<u8>) {
        let data_like_rst = [0u8, 0, 0, 0];
        let pieces: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]), frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])),
            (frame(0x1, 0x4, 1, b"\x88"), frame(0x1, 0x4, 1, b"\x88")),
            // DATA of four zero bytes: not a reset.
            (frame(0x0, 0, 1, &data_like_rst), frame(0x0, 0, 1, &data_like_rst)),
            (frame(0x3, 0, 1, &[0, 0, 0, 0]), frame(0x3, 0, 1, &[0, 0, 0, CANCEL])),
            // Other codes pass unchanged, REFUSED_STREAM (7) among them.
            (frame(0x3, 0, 3, &[0, 0, 0, 7]), frame(0x3, 0, 3, &[0, 0, 0, 7])),
            (frame(0x3, 0, 5, &[0, 0, 1, 0]), frame(0x3, 0, 5, &[0, 0, 1, 0])),
            (frame(0x0, 0x1, 7, &[]), frame(0x0, 0x1, 7, &[])),
            // GOAWAY(NO_ERROR) is the graceful shutdown: unchanged.
            (frame(0x7, 0, 0, &[0, 0, 0, 9, 0, 0, 0, 0]), frame(0x7, 0, 0, &[0, 0, 0, 9, 0, 0, 0, 0])),
            (frame(0x3, 0, 9, &[0, 0, 0, 0]), frame(0x3, 0, 9, &[0, 0, 0, CANCEL])),
            (frame(0x0, 0, 11, &vec![0; 70_000]), frame(0x0, 0, 11, &vec![0; 70_000])),
        ];
        pieces.into_iter().fold((Vec::new(), Vec::new()), |(mut a, mut b), (x, y)| {
            a.extend(x);
            b.extend(y);
            (a, b)
        })
    }

    #[test]
    fn a_no_error_reset_reads_as_cancel_and_nothing_else_changes() {
        let (mut sent, read) = sample();
        Frames::new().pass(&mut sent);
        assert_eq!(sent, read);
    }

    proptest! {
        #[test]
        fn the_same_however_the_bytes_are_split(cuts in proptest::collection::vec(0usize..70_200, 0..40)) {
            let (sent, read) = sample();
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|c| *c < sent.len()).collect();
            cuts.sort_unstable();
            let mut frames = Frames::new();
            let mut out = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([sent.len()]) {
                let mut piece = sent[from..cut].to_vec();
                frames.pass(&mut piece);
                out.extend(piece);
                from = cut;
            }
            prop_assert_eq!(out, read);
        }
    }
}
