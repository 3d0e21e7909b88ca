//! Group commit for a database backend: requests hand their writes to a
//! gatherer, and one worker at a time takes every write waiting and sends them
//! as one statement (one transaction, one commit). Two shapes: [`Gather`] for
//! writes of any key at all (dedup's claims and outcomes), [`ByKey`] for
//! writes that must go one batch at a time per key, in arrival order (a queued
//! lease's acceptances, which take its places in turn).
//!
//! No timer: a lone write goes at once, and the writes that queue while a batch
//! is in flight form the next one — as the sled backend's flusher gathers its
//! records. Under load a batch is as large as the number of requests that
//! arrived during one round trip and commit, so the commits per request fall as
//! the load grows, and an idle instance waits for nothing.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;

use tokio::sync::{mpsc, Mutex};

/// Hands items to the batch workers.
pub(super) struct Gather<I> {
    tx: mpsc::UnboundedSender<I>,
}

impl<I: Send + 'static> Gather<I> {
    /// Starts `workers` tasks that each take up to `max` waiting items and run
    /// them with `run`; a worker takes its next batch only once its last one is
    /// done, so at most `workers` batches are in flight. The tasks end when the
    /// gatherer is dropped and the queue is empty.
    pub(super) fn start<F, Fut>(workers: usize, max: usize, run: F) -> Gather<I>
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(rx));
        let run = Arc::new(run);
        for _ in 0..workers.max(1) {
            let (rx, run) = (Arc::clone(&rx), Arc::clone(&run));
            tokio::spawn(async move {
                while let Some(batch) = next_batch(&rx, max.max(1)).await {
                    run(batch).await;
                }
            });
        }
        Gather { tx }
    }

    /// Queues `item` for the next batch; gives it back when the workers have
    /// stopped.
    pub(super) fn submit(&self, item: I) -> Result<(), I> {
        self.tx.send(item).map_err(|e| e.0)
    }
}

/// Waits for one item, then takes whatever else is already waiting.
async fn next_batch<I>(rx: &Mutex<mpsc::UnboundedReceiver<I>>, max: usize) -> Option<Vec<I>> {
    let mut rx = rx.lock().await;
    let first = rx.recv().await?;
    let mut batch = Vec::with_capacity(max.min(64));
    batch.push(first);
    while batch.len() < max {
        match rx.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// Group commit per key: the items of one key go in batches, one batch of the
/// key at a time, in the order they were submitted; keys run side by side. A
/// lone item goes at once (its own task), and what arrives while a key's
/// batch is in flight forms that key's next batch.
pub(crate) struct ByKey<K, I> {
    waiting: Arc<std::sync::Mutex<HashMap<K, Vec<I>>>>,
    /// How many of a key's waiting items (at least one) the next batch takes.
    take: fn(&[I]) -> usize,
}

impl<K: Hash + Eq + Clone + Send + 'static, I: Send + 'static> ByKey<K, I> {
    pub(crate) fn new(take: fn(&[I]) -> usize) -> ByKey<K, I> {
        ByKey {
            waiting: Arc::default(),
            take,
        }
    }

    /// Queues `item` under `key`; when no batch of `key` is running, starts
    /// the task that runs them with `run` until none waits. The task is its
    /// own: no submitter's going away cuts what the others wait on.
    pub(crate) fn submit<F, Fut>(&self, key: K, item: I, run: F)
    where
        F: Fn(K, Vec<I>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let lead = {
            let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
            match waiting.get_mut(&key) {
                Some(q) => {
                    q.push(item);
                    false
                }
                None => {
                    waiting.insert(key.clone(), vec![item]);
                    true
                }
            }
        };
        if lead {
            let (waiting, take) = (self.waiting.clone(), self.take);
            tokio::spawn(async move {
                loop {
                    let batch: Vec<I> = {
                        let mut w = waiting.lock().unwrap_or_else(|p| p.into_inner());
                        let Some(q) = w.get_mut(&key) else {
                            return;
                        };
                        if q.is_empty() {
                            w.remove(&key);
                            return;
                        }
                        let n = take(q).clamp(1, q.len());
                        q.drain(..n).collect()
                    };
                    run(key.clone(), batch).await;
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::oneshot;

    /// What queues while a batch is in flight goes together next; a lone item
    /// waits for nothing.
    #[tokio::test(start_paused = true)]
    async fn the_batch_that_forms_while_one_is_in_flight_goes_next() {
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<Vec<u32>>();
        let g = Gather::start(1, 100, move |batch: Vec<(u32, oneshot::Sender<()>)>| {
            let seen_tx = seen_tx.clone();
            async move {
                seen_tx
                    .send(batch.iter().map(|(n, _)| *n).collect())
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
                for (_, done) in batch {
                    let _ = done.send(());
                }
            }
        });
        let (a, wait_a) = oneshot::channel();
        g.submit((1, a)).map_err(|_| ()).unwrap();
        assert_eq!(seen.recv().await.unwrap(), vec![1]);
        let mut waits = Vec::new();
        for n in 2..=5 {
            let (tx, rx) = oneshot::channel();
            g.submit((n, tx)).map_err(|_| ()).unwrap();
            waits.push(rx);
        }
        wait_a.await.unwrap();
        assert_eq!(seen.recv().await.unwrap(), vec![2, 3, 4, 5]);
        for w in waits {
            w.await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_is_never_larger_than_max() {
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<usize>();
        let g = Gather::start(1, 3, move |batch: Vec<u32>| {
            let seen_tx = seen_tx.clone();
            async move {
                seen_tx.send(batch.len()).unwrap();
            }
        });
        for n in 0..7 {
            g.submit(n).unwrap();
        }
        let mut sizes = Vec::new();
        while sizes.iter().sum::<usize>() < 7 {
            sizes.push(seen.recv().await.unwrap());
        }
        assert!(sizes.iter().all(|s| *s <= 3), "{sizes:?}");
    }

    /// A key's items go one batch at a time, in order, what waited meanwhile
    /// together; another key's go beside them.
    #[tokio::test(start_paused = true)]
    async fn by_key_runs_one_batch_of_a_key_at_a_time_in_order() {
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<(char, Vec<u32>)>();
        let g: ByKey<char, u32> = ByKey::new(|q| q.len().min(3));
        let run = move |k: char, batch: Vec<u32>| {
            let seen_tx = seen_tx.clone();
            async move {
                seen_tx.send((k, batch)).unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        for n in 0..5 {
            g.submit('a', n, run.clone());
        }
        g.submit('b', 9, run.clone());
        let mut a = Vec::new();
        let mut b = Vec::new();
        while a.iter().map(Vec::len).sum::<usize>() < 5 || b.is_empty() {
            let (k, batch) = seen.recv().await.unwrap();
            if k == 'a' {
                a.push(batch)
            } else {
                b.push(batch)
            }
        }
        assert_eq!(a, vec![vec![0, 1, 2], vec![3, 4]]);
        assert_eq!(b, vec![vec![9]]);
        // The key's task ended: the next item starts a new one.
        g.submit('a', 7, run);
        assert_eq!(seen.recv().await.unwrap(), ('a', vec![7]));
    }
}
