// A few markdown forms for the playground's answers (app.js calls renderMarkdown).
"use strict";

// Escaped first, then a few markdown forms become tags: the model's text can never become markup of its own.
function escapeHtml(text) {
  const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return text.replace(/[&<>"']/g, (c) => entities[c]);
}

function inline(text) {
  return text
    .split(/(`[^`]+`)/)
    .map((piece, i) => {
      if (i % 2) return `<code>${escapeHtml(piece.slice(1, -1))}</code>`;
      return escapeHtml(piece)
        .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
        .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
    })
    .join("");
}

function renderBlocks(text) {
  const out = [];
  let list = null;
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    paragraph = [];
    if (list) out.push(`</${list}>`);
    list = null;
  };
  for (const line of text.split("\n")) {
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*]|\d+\.)\s+(.*)$/);
    if (heading) {
      flush();
      out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
    } else if (item) {
      const kind = /\d/.test(item[1]) ? "ol" : "ul";
      if (paragraph.length || list !== kind) flush();
      if (!list) out.push(`<${(list = kind)}>`);
      out.push(`<li>${inline(item[2])}</li>`);
    } else if (!line.trim()) {
      flush();
    } else {
      if (list) flush();
      paragraph.push(line.startsWith("> ") ? line.slice(2) : line);
    }
  }
  flush();
  return out.join("");
}

function renderMarkdown(text) {
  return text
    .split("```")
    .map((part, i) => {
      if (i % 2 === 0) return renderBlocks(part);
      const code = part.includes("\n") ? part.slice(part.indexOf("\n") + 1) : part;
      return `<pre><code>${escapeHtml(code)}</code></pre>`;
    })
    .join("");
}
