//! Server-Sent Events, read from a streamed body: `id:`, `event:` and
//! `data:` lines up to a blank line make one message; `:` lines are
//! keep-alive comments.

use hyper::body::Incoming;

use super::http::next_chunk;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Message {
    pub id: Option<String>,
    pub event: String,
    pub data: String,
}

pub struct Reader {
    body: Incoming,
    buf: Vec<u8>,
}

impl Reader {
    pub fn new(body: Incoming) -> Self {
        Self {
            body,
            buf: Vec::new(),
        }
    }

    /// The next message; None when the stream ends.
    pub async fn next(&mut self) -> Result<Option<Message>, hyper::Error> {
        loop {
            if let Some(msg) = take_message(&mut self.buf) {
                return Ok(Some(msg));
            }
            match next_chunk(&mut self.body).await? {
                Some(chunk) => self.buf.extend_from_slice(&chunk),
                None => return Ok(None),
            }
        }
    }
}

/// Cut the first complete message (one that ends in a blank line) off `buf`.
fn take_message(buf: &mut Vec<u8>) -> Option<Message> {
    loop {
        let end = buf.windows(2).position(|w| w == b"\n\n")?;
        let block = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end + 2);
        let mut msg = Message::default();
        let mut data: Vec<&str> = Vec::new();
        for line in block.lines() {
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "id" => msg.id = Some(value.to_owned()),
                "event" => msg.event = value.to_owned(),
                "data" => data.push(value),
                _ => {}
            }
        }
        if data.is_empty() {
            continue;
        }
        msg.data = data.join("\n");
        return Some(msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_comments() {
        let mut buf =
            b": keep-alive\n\nid: 7\nevent: lease.acquired\ndata: {\"seq\":7}\n\nid: 8\ndata: x"
                .to_vec();
        assert_eq!(
            take_message(&mut buf),
            Some(Message {
                id: Some("7".into()),
                event: "lease.acquired".into(),
                data: "{\"seq\":7}".into()
            })
        );
        assert_eq!(
            take_message(&mut buf),
            None,
            "the second is not complete yet"
        );
        buf.extend_from_slice(b"\n\n");
        assert_eq!(take_message(&mut buf).map(|m| m.data), Some("x".into()));
    }
}
