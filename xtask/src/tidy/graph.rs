//! The import graph's circles: Tarjan's strongly connected components, and one shortest
//! loop through each.

use std::collections::{BTreeMap, BTreeSet};

/// A circle of the import graph: one strongly connected component of more than one file.
#[derive(Debug, PartialEq)]
pub struct Circle {
    /// Every file of the component, sorted.
    pub files: Vec<String>,
    /// One shortest loop through its first file, that file repeated at the end.
    pub path: Vec<String>,
}

/// The circles of a graph, sorted by their first file.
pub fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Circle> {
    let nodes: Vec<&String> = graph.keys().collect();
    let index: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let edges: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            graph[*n]
                .iter()
                .filter_map(|t| index.get(t).copied())
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    for mut component in strongly_connected(&edges) {
        if component.len() < 2 {
            continue;
        }
        component.sort();
        let inside: BTreeSet<usize> = component.iter().copied().collect();
        let start = component[0];
        let mut path: Vec<String> = shortest_cycle(start, &edges, &inside)
            .iter()
            .map(|i| nodes[*i].clone())
            .collect();
        path.push(nodes[start].clone());
        let files = component.iter().map(|i| nodes[*i].clone()).collect();
        out.push(Circle { files, path });
    }
    out.sort_by(|a, b| a.files.cmp(&b.files));
    out
}

/// Tarjan's strongly connected components, iteratively.
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = edges.len();
    let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on_stack, mut stack, mut out) = (vec![false; n], Vec::new(), Vec::new());
    let mut next = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0usize)];
        while let Some(&mut (v, ref mut child)) = work.last_mut() {
            if *child == 0 {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = edges[v].get(*child) {
                *child += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                out.push(component);
            }
        }
    }
    out
}

/// The shortest way from `start` back to itself inside one component (breadth first).
fn shortest_cycle(start: usize, edges: &[Vec<usize>], inside: &BTreeSet<usize>) -> Vec<usize> {
    let mut came_from = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in &edges[v] {
            if !inside.contains(&w) {
                continue;
            }
            if w == start {
                let mut path = vec![v];
                while let Some(&p) = came_from.get(path.last().unwrap_or(&start)) {
                    path.push(p);
                }
                path.reverse();
                return path;
            }
            if w != start && !came_from.contains_key(&w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    vec![start]
}
